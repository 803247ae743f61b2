-- 015 (batcher): deletes reach incremental and follow runs.
--
-- batch_deletes is written by the triggers `batcher follow-trigger
-- --install` puts on a source table (batch.FollowTriggerSQL), in the
-- writer's own transaction: one row per deleted source row (source_id, the
-- job's id column as text) and one per TRUNCATE (source_id NULL, truncated).
-- id orders the captures; a run of an incremental job with vanished: delete
-- reads the captures of its table up to a mark fixed when the run is created
-- (after the writers open then have ended, so no capture below the mark
-- commits later) and turns the live normalized rows among them into
-- tombstones and delete events, in the transaction that creates the run.
-- One index, on id only (each capture is an insert in a writer's
-- transaction, and a rising bigint is the cheapest key to add to): ids are
-- unique by their sequence, and every read and delete goes by an id range
-- (the table is a filter on it).
CREATE TABLE batch_deletes (
    id            bigserial   NOT NULL,
    source_schema text        NOT NULL,
    source_table  text        NOT NULL,
    source_id     text,
    truncated     boolean     NOT NULL DEFAULT false,
    captured_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX batch_deletes_id ON batch_deletes (id);

-- Where each job's drain stands, written in the transaction that writes its
-- tombstones: every capture of the table up to capture_id, and every row
-- whose change value is at or below exit_mark and that left the job's scope
-- (filter, partition list), is a tombstone already. Captures below every
-- job's capture_id for their table are deleted by the next drain.
CREATE TABLE batch_delete_marks (
    job           text        PRIMARY KEY,
    source_schema text        NOT NULL,
    source_table  text        NOT NULL,
    capture_id    bigint      NOT NULL,
    exit_mark     text,
    tombstones    bigint      NOT NULL DEFAULT 0,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
