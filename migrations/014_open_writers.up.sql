-- 014 (batcher): a run start waiting for transactions that wrote the source
-- table (batch.Config.OpenWritersWait, the batcher's OPEN_WRITERS_WAIT)
-- says so here, one row per job, so that `batcher status` and the
-- batch_open_writers_wait_seconds gauge show it from any process. The
-- waiting batcher writes the row (outside its run-start transaction) once
-- the wait has lasted a second, refreshes checked_at while it waits, sets
-- expired_at when it gives up, and deletes the row in the transaction that
-- creates the run. follower: the waiting batcher is a follower, which tries
-- again after giving up. since survives a follower's retries: a row checked
-- in the last minute keeps it.
CREATE TABLE batch_open_writers (
    job        text PRIMARY KEY,
    source     text NOT NULL,
    writers    text NOT NULL,
    since      timestamptz NOT NULL,
    checked_at timestamptz NOT NULL,
    expired_at timestamptz,
    follower   boolean NOT NULL DEFAULT false
);
