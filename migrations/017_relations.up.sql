-- 017 (batcher): documents built from related tables (spec
-- document.relations) are rebuilt when a related row changes.
--
-- batch_relation_changes is written by the capture triggers `batcher
-- follow-trigger --install` puts on every related and join table of a
-- relation job (batch.FollowTriggerSQL), in the writer's own transaction,
-- with one INSERT … SELECT per statement: one row per distinct (node, key)
-- the statement touched, where node names the relation (its path in the
-- spec, "#through" for its join table) and key is the changed row's value
-- of the column that joins it to its parent (the old and the new value of
-- an UPDATE). Nothing is resolved in the writer: each new run of the job
-- deletes the captures it can see and turns them, through the spec's joins,
-- into the ids of the root rows whose documents contain them
-- (batch_relation_work), in the transaction that creates the run. A parent
-- shared by many roots is one capture here and many work rows there.
CREATE TABLE batch_relation_changes (
    id          bigserial   NOT NULL,
    job         text        NOT NULL,
    node        text        NOT NULL,
    key         text        NOT NULL,
    captured_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX batch_relation_changes_job ON batch_relation_changes (job, id);

-- The roots whose documents a relation job must rebuild. The run's sweep
-- phase (leased like the sweep) takes them in chunks: each chunk deletes
-- its work rows and writes the rebuilt documents and their events in one
-- transaction, so a crash leaves every root either rebuilt or still here.
CREATE TABLE batch_relation_work (
    job       text        NOT NULL,
    root_id   text        NOT NULL,
    queued_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, root_id)
);

-- What the relation phase of a run rebuilt: roots read, documents changed.
ALTER TABLE batch_sweeps
    ADD COLUMN rebuilt_count bigint NOT NULL DEFAULT 0,
    ADD COLUMN rebuilt_changed bigint NOT NULL DEFAULT 0;
