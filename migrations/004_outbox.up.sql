-- 004: the publisher's bookkeeping: who is alive, who owns which outbox
-- shard, where published rows are kept for a retention period, and where
-- events the broker rejects for good are parked. See outbox/doc.go.

-- One row per running publisher, renewed on every heartbeat. The number of
-- live rows decides how many shards each publisher should own.
CREATE TABLE outbox_publishers (
    id           text        PRIMARY KEY,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL
);

-- One lease per outbox shard (outboxrelay_shard: 0..63). epoch grows on
-- every claim, so a publisher that lost a shard and still holds an old epoch
-- cannot mark its events published.
CREATE TABLE outbox_shard_leases (
    shard       smallint    PRIMARY KEY CHECK (shard BETWEEN 0 AND 63),
    owner       text,
    epoch       bigint      NOT NULL DEFAULT 0,
    expires_at  timestamptz,
    acquired_at timestamptz
);
INSERT INTO outbox_shard_leases (shard) SELECT s FROM generate_series(0, 63) AS s;

-- Published events, kept only when the publisher runs with a retention
-- (--retention > 0), then deleted in batches. With retention 0 (the default)
-- published rows are deleted at once and this table stays empty.
CREATE TABLE outbox_published (
    id                bigint      PRIMARY KEY,
    event_id          uuid        NOT NULL,
    topic             text        NOT NULL,
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint      NOT NULL,
    event_type        text        NOT NULL,
    payload           jsonb,
    headers           jsonb       NOT NULL,
    shard             smallint    NOT NULL,
    created_at        timestamptz NOT NULL,
    published_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_published_published_at ON outbox_published (published_at);

-- Events the broker rejected permanently (too large, invalid topic, ...),
-- moved out of outbox_events with the error so the rest of their shard goes
-- on. `publisher dead-letter retry` puts them back.
CREATE TABLE outbox_dead_letters (
    id                bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    outbox_id         bigint      NOT NULL,
    event_id          uuid        NOT NULL,
    topic             text        NOT NULL,
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint      NOT NULL,
    event_type        text        NOT NULL,
    payload           jsonb,
    headers           jsonb       NOT NULL,
    shard             smallint    NOT NULL,
    created_at        timestamptz NOT NULL,
    error             text        NOT NULL,
    error_code        integer,
    failed_at         timestamptz NOT NULL DEFAULT now()
);

-- Wake publishers when events commit, naming the shards to look at: the
-- payload is the statement's distinct shards ("3,17,42"), so a publisher
-- wakes exactly those shard workers without a query. Statement level: one
-- notification per INSERT statement whatever its size (a 10,000-row chunk
-- touches at most 64 shards: under 200 bytes), none when ON CONFLICT DO
-- NOTHING inserted nothing; PostgreSQL folds identical notifications of one
-- transaction and delivers them at commit.
CREATE FUNCTION outboxrelay_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    shards text;
BEGIN
    SELECT string_agg(DISTINCT shard::text, ',') INTO shards FROM new_events;
    IF shards IS NOT NULL THEN
        PERFORM pg_notify('outboxrelay_outbox', shards);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER outbox_events_notify
AFTER INSERT ON outbox_events
REFERENCING NEW TABLE AS new_events
FOR EACH STATEMENT EXECUTE FUNCTION outboxrelay_outbox_notify();
