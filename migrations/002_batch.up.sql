-- 002: the batcher's state. A run is (job, logical_run_id, partition_key);
-- its row is the checkpoint: the cursor it promises is committed, the
-- boundary fixed at start, the processor version and scope it was made with,
-- and the lease that fences every write.

-- batch_jobs keeps the last spec each job ran with, so `run --job`,
-- `quarantine retry` and `status` work without the spec file.
CREATE TABLE batch_jobs (
    job        text        PRIMARY KEY,
    spec       jsonb       NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE batch_runs (
    job               text        NOT NULL,
    logical_run_id    text        NOT NULL,
    partition_key     text        NOT NULL DEFAULT '',
    state             text        NOT NULL DEFAULT 'pending'
                      CHECK (state IN ('pending', 'running', 'paused', 'succeeded', 'failed', 'superseded')),
    mode              text        NOT NULL DEFAULT 'full' CHECK (mode IN ('full', 'incremental')),
    -- Cursor and boundary are the cursor columns' values as text, cast back
    -- to the columns' types by the compiled SQL. NULL cursor = before the
    -- first row; NULL boundary = the scope was empty at start.
    start_cursor      text[],
    cursor            text[],
    boundary          text[],
    processor_version text        NOT NULL,
    scope_hash        text        NOT NULL,
    scope             jsonb       NOT NULL,
    processed_count   bigint      NOT NULL DEFAULT 0 CHECK (processed_count >= 0),
    changed_count     bigint      NOT NULL DEFAULT 0 CHECK (changed_count >= 0),
    quarantined_count bigint      NOT NULL DEFAULT 0 CHECK (quarantined_count >= 0),
    estimated_total   bigint,
    chunk_size        integer,
    chunks            bigint      NOT NULL DEFAULT 0,
    retries           bigint      NOT NULL DEFAULT 0,
    lease_owner       text,
    lease_token       uuid,
    heartbeat_at      timestamptz,
    -- The holder's own TTL decides when others may take the partition.
    lease_expires_at  timestamptz,
    attempt           integer     NOT NULL DEFAULT 0,
    error             text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    started_at        timestamptz,
    checkpoint_at     timestamptz,
    finished_at       timestamptz,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, logical_run_id, partition_key)
);
CREATE INDEX batch_runs_job_created ON batch_runs (job, created_at DESC);

-- The parts of the checkpoint invariant that need no knowledge of the cursor
-- columns' types: the count never goes back and a cursor, once set, is never
-- cleared. (Monotonic cursor and "never past the boundary" are compared with
-- the real types by the batcher's compiled checkpoint UPDATE.)
CREATE FUNCTION batch_runs_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.processed_count < OLD.processed_count THEN
        RAISE EXCEPTION 'batch_runs %/%/%: processed_count must not go back (% -> %)',
            OLD.job, OLD.logical_run_id, OLD.partition_key, OLD.processed_count, NEW.processed_count
            USING ERRCODE = 'check_violation';
    END IF;
    IF OLD.cursor IS NOT NULL AND NEW.cursor IS NULL THEN
        RAISE EXCEPTION 'batch_runs %/%/%: cursor must not be cleared; move it back with a new run',
            OLD.job, OLD.logical_run_id, OLD.partition_key
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER batch_runs_guard BEFORE UPDATE ON batch_runs
    FOR EACH ROW EXECUTE FUNCTION batch_runs_guard();

-- Rows a quarantine-policy job set aside: the id and the error, never the
-- payload (it may hold personal data); `batcher quarantine retry` replays
-- them from the source table.
CREATE TABLE batch_quarantine (
    job            text        NOT NULL,
    logical_run_id text        NOT NULL,
    partition_key  text        NOT NULL DEFAULT '',
    source_id      text        NOT NULL,
    error_code     text        NOT NULL,
    message        text        NOT NULL,
    attempts       integer     NOT NULL DEFAULT 1,
    first_seen_at  timestamptz NOT NULL DEFAULT now(),
    last_seen_at   timestamptz NOT NULL DEFAULT now(),
    resolved_at    timestamptz,
    PRIMARY KEY (job, logical_run_id, source_id)
);
CREATE INDEX batch_quarantine_open ON batch_quarantine (job) WHERE resolved_at IS NULL;

-- Every checkpoint moved by hand: who, why, before, after. A backwards move
-- starts a new run; new_logical_run_id names it.
CREATE TABLE checkpoint_audit (
    id                 bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job                text        NOT NULL,
    logical_run_id     text        NOT NULL,
    partition_key      text        NOT NULL,
    actor              text        NOT NULL,
    reason             text        NOT NULL CHECK (reason <> ''),
    action             text        NOT NULL,
    before_cursor      text[],
    after_cursor       text[],
    before_processed   bigint,
    new_logical_run_id text,
    created_at         timestamptz NOT NULL DEFAULT now()
);
