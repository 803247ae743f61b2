-- 001: the outbox and the normalized read model that every stage shares.

-- outboxrelay_shard maps an aggregate id onto one of 64 outbox shards. All
-- events of one aggregate land in one shard, so a publisher that owns the
-- shard sees them in order. IMMUTABLE so it can feed a generated column.
CREATE FUNCTION outboxrelay_shard(aggregate_id text) RETURNS smallint
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT
AS $$ SELECT ((hashtextextended(aggregate_id, 0) & 9223372036854775807) % 64)::smallint $$;

-- outboxrelay_event_id derives a deterministic event id: the same source row,
-- source version and processor version always give the same uuid, so a chunk
-- that is replayed after a crash cannot enqueue a second event for it.
-- Keep in step with outbox.EventID (Go).
CREATE FUNCTION outboxrelay_event_id(source text, source_id text, source_version bigint, processor_version text)
RETURNS uuid
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT
AS $$ SELECT md5(source || chr(31) || source_id || chr(31) || source_version::text || chr(31) || processor_version)::uuid $$;

CREATE TABLE outbox_events (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id          uuid        NOT NULL UNIQUE,
    topic             text        NOT NULL,
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint      NOT NULL,
    event_type        text        NOT NULL CHECK (event_type <> ''),
    payload           jsonb,
    headers           jsonb       NOT NULL DEFAULT '{}',
    shard             smallint    NOT NULL GENERATED ALWAYS AS (outboxrelay_shard(aggregate_id)) STORED,
    -- The writing transaction's id: a publisher can tell events whose
    -- transaction is still open from events it has already passed.
    xact_id           xid8        NOT NULL DEFAULT pg_current_xact_id(),
    created_at        timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX outbox_events_shard_id ON outbox_events (shard, id);

-- The read model: one row per source row, guarded so an older source version
-- never overwrites a newer one (see batch.UpsertSQL).
CREATE TABLE normalized_records (
    source            text        NOT NULL,
    source_id         text        NOT NULL,
    document          jsonb,
    source_version    bigint      NOT NULL,
    processor_version text        NOT NULL,
    deleted           boolean     NOT NULL DEFAULT false,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, source_id)
);
