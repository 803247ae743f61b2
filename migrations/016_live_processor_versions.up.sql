-- 016 (batcher, indexer): the live processor version of each scan job.
--
-- One row per (job, processor version) a run was prepared at: the
-- versions a job registered (the indexer creates generations only for
-- these, when it has DATABASE_URL). live marks the version whose index
-- generation searches read now, at most one per job; first_live_at is set
-- once it has been live (a run at a version that was live before and is
-- not now is refused unless declared a rebuild, and an automatic cutover
-- never moves back to it). A run of a job with nothing recorded makes its
-- version live; an indexer cutover or rollback moves live.
CREATE TABLE batch_processor_versions (
    job               text        NOT NULL,
    processor_version text        NOT NULL,
    registered_at     timestamptz NOT NULL DEFAULT now(),
    live              boolean     NOT NULL DEFAULT false,
    first_live_at     timestamptz,
    live_since        timestamptz,
    left_at           timestamptz,
    PRIMARY KEY (job, processor_version),
    CHECK (NOT live OR first_live_at IS NOT NULL)
);
CREATE UNIQUE INDEX batch_processor_versions_live ON batch_processor_versions (job) WHERE live;

-- The versions jobs ran at before this migration are registered (an
-- indexer with DATABASE_URL keeps writing their events), none live: which
-- one searches read is in the search engine. The next run of a job
-- records its version as live only when it is the job's only registered
-- version; otherwise the next indexer cutover or rollback records the
-- live version, and the one the documents left as having been live.
INSERT INTO batch_processor_versions (job, processor_version)
SELECT DISTINCT job, processor_version FROM batch_runs WHERE processor_version IS NOT NULL
ON CONFLICT DO NOTHING;

-- Every move of a job's live version: who moved it, how (first run,
-- cutover, automatic cutover, rollback), from and to which version.
CREATE TABLE batch_live_version_moves (
    id                bigserial   PRIMARY KEY,
    job               text        NOT NULL,
    from_version      text,
    to_version        text        NOT NULL,
    how               text        NOT NULL,
    actor             text        NOT NULL,
    moved_at          timestamptz NOT NULL DEFAULT now()
);
