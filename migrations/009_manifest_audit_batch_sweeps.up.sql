-- 009: a manifest audit row keeps both sides of its match fields; the batcher
-- sweeps what vanished from a full run's scope (batch_sweeps, below).
--
-- manifest_audit.fields now holds the approved fields the chunk's UPDATE
-- matched (copied from manifest_items), so verifying the audit against the
-- approved list compares like with like even when a trigger on the target
-- rewrites a match field or the drainer's TimeZone renders it otherwise.
-- after_fields holds the match fields as the row held them after the UPDATE
-- and its triggers: what the report compares the current row with. Rows
-- written before 009 have after_fields NULL and their fields were read back
-- after the UPDATE, as before.
ALTER TABLE manifest_audit ADD COLUMN after_fields jsonb;

-- 009 (batcher): the sweep of a full run (spec vanished: delete). After
-- every partition of the run succeeded, the rows of normalized_records the
-- run's scope no longer has become tombstones and delete events, in chunks
-- by source_id; this row is the sweep's checkpoint (a promise like
-- batch_runs.cursor: every candidate up to cursor is swept and committed)
-- and its lease, which fences every chunk.
CREATE TABLE batch_sweeps (
    job              text        NOT NULL,
    logical_run_id   text        NOT NULL,
    state            text        NOT NULL DEFAULT 'pending'
                     CHECK (state IN ('pending', 'running', 'succeeded', 'failed', 'superseded')),
    -- The last normalized_records.source_id swept; NULL = none yet.
    cursor           text,
    swept_count      bigint      NOT NULL DEFAULT 0,
    deleted_count    bigint      NOT NULL DEFAULT 0,
    chunks           bigint      NOT NULL DEFAULT 0,
    lease_owner      text,
    lease_token      uuid,
    heartbeat_at     timestamptz,
    lease_expires_at timestamptz,
    attempt          integer     NOT NULL DEFAULT 0,
    error            text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    started_at       timestamptz,
    checkpoint_at    timestamptz,
    finished_at      timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, logical_run_id)
);

-- 009 (batcher): automatic retries of a failed partition (spec
-- errors.partition_attempts / partition_backoff). failures counts the
-- partition's failed attempts; retry_at is when a worker may claim it again
-- after one; last_error keeps the newest failure's message (error is
-- cleared when a worker claims the partition).
ALTER TABLE batch_runs
    ADD COLUMN failures   integer NOT NULL DEFAULT 0 CHECK (failures >= 0),
    ADD COLUMN retry_at   timestamptz,
    ADD COLUMN last_error text;
