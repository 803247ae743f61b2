-- 003: manifest jobs (seed 003): finish an interrupted batch over a frozen,
-- approved list of items. See manifest/doc.go.

-- One row per registered job. The row is the job's lock: a chunk takes it
-- FOR UPDATE, so two workers never pick the same next_index.
CREATE TABLE manifest_jobs (
    job_id        text        PRIMARY KEY CHECK (job_id <> ''),
    tenant        text        NOT NULL,
    -- The normalized target, transition and topic (everything but the items)
    -- as registered; drain and report build their SQL from it.
    spec          jsonb       NOT NULL,
    chunk_size    integer     NOT NULL CHECK (chunk_size > 0),
    item_count    integer     NOT NULL CHECK (item_count > 0),
    -- sha256 of the normalized items and of the whole normalized job: same
    -- hash = same approval, whatever order the file listed the items in.
    items_hash    text        NOT NULL,
    content_hash  text        NOT NULL,
    -- Index into the frozen item array of the next item to apply. A promise:
    -- items [0, next_index) are changed and audited.
    next_index    integer     NOT NULL DEFAULT 0 CHECK (next_index >= 0),
    state         text        NOT NULL DEFAULT 'pending'
                  CHECK (state IN ('pending', 'running', 'succeeded', 'conflicted')),
    -- Why the job is conflicted: the chunk and each item that no longer matched.
    conflict      jsonb,
    chunks_done   integer     NOT NULL DEFAULT 0,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz
);

-- The frozen, approved list, sorted by id at registration. Never updated.
CREATE TABLE manifest_items (
    job_id    text    NOT NULL REFERENCES manifest_jobs (job_id),
    seq       integer NOT NULL CHECK (seq >= 0),
    item_id   text    NOT NULL,
    revision  bigint  NOT NULL,
    fields    jsonb   NOT NULL DEFAULT '{}',
    PRIMARY KEY (job_id, seq),
    UNIQUE (job_id, item_id)
);

-- One row per applied item, written in the chunk's transaction. The keys
-- make a second change of the same item impossible.
CREATE TABLE manifest_audit (
    job_id          text        NOT NULL REFERENCES manifest_jobs (job_id),
    seq             integer     NOT NULL,
    item_id         text        NOT NULL,
    chunk           integer     NOT NULL,
    before_revision bigint      NOT NULL,
    after_revision  bigint      NOT NULL,
    before_status   text        NOT NULL,
    after_status    text        NOT NULL,
    -- The expected fields as the UPDATE found them (RETURNING), so verifying
    -- the audit against the items checks what the database saw.
    fields          jsonb       NOT NULL,
    committed_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, seq),
    UNIQUE (job_id, item_id)
);
