-- 012: the publisher's run metrics read only what is not finished.
--
-- batch_runs keeps every run; a `--follow` job adds one per burst of
-- changes, so the table grows without bound. The metrics the publisher
-- reads at every scrape (batch_runs{job,state}, batch_run_stalled_seconds)
-- count a job's partitions that are pending, running, paused or failed,
-- and its running sweeps: these partial indexes hold only those rows, so
-- a scrape costs what is unfinished, not the whole history.
CREATE INDEX batch_runs_unfinished ON batch_runs (job, state)
    WHERE state IN ('pending', 'running', 'paused', 'failed');
CREATE INDEX batch_sweeps_running ON batch_sweeps (job)
    WHERE state = 'running';
