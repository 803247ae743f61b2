-- 005: one physical table per outbox shard.
--
-- Until 004 every shard's events were interleaved in one heap: a publisher
-- reading 2,000 events of one shard touched about 2,000 heap pages, and the
-- deletes that followed touched them again. Hash-partitioning outbox_events
-- by aggregate_id into 64 partitions, one per shard, keeps each shard's
-- events together, so a shard's batch is read and deleted from a few
-- hundred consecutive pages. The publisher reads and deletes straight from
-- its shard's partition (outbox_events_s00 .. outbox_events_s63); inserts
-- still go through outbox_events. See outbox/doc.go, "Shards".
--
-- Upgrade the writers first (batcher, and applications calling
-- outbox.Enqueue from a release with this migration): they insert with a
-- plain ON CONFLICT DO NOTHING, which works before and after it, while an
-- older writer's ON CONFLICT (event_id) finds no matching unique index
-- afterwards. Then run it with the publishers stopped: the table is rebuilt
-- under an exclusive lock (writers wait for it; the copy takes about as long
-- as inserting the waiting events again, so drain the outbox first when it
-- is large), and its events move to the shards of the new shard function.
-- Privileges on the old table carry over; storage parameters and
-- publication membership do not.

-- outboxrelay_shard is now exactly the partition PostgreSQL's hash
-- partitioning picks for aggregate_id among 64 partitions: the text hash
-- with the partitioning seed (HASH_PARTITION_SEED, 0x7A5B22367996DCFD),
-- passed through hash_combine64 (adds 0x49a0f4dd15e5a8e3, whose low six
-- bits are 35), modulo 64. Each partition's CHECK (shard = N) proves it on
-- every insert: a mismatch fails loudly instead of filing an event under
-- the wrong lease.
CREATE OR REPLACE FUNCTION outboxrelay_shard(aggregate_id text) RETURNS smallint
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT
AS $$ SELECT (((hashtextextended(aggregate_id, 8816678312871386365) & 63) + 35) % 64)::smallint $$;

-- The old table steps aside with its sequence and index names free for
-- the new one.
ALTER TABLE outbox_events RENAME TO outbox_events_004;
ALTER SEQUENCE outbox_events_id_seq RENAME TO outbox_events_004_id_seq;
DROP TRIGGER outbox_events_notify ON outbox_events_004;
ALTER TABLE outbox_events_004 DROP CONSTRAINT outbox_events_pkey, DROP CONSTRAINT outbox_events_event_id_key,
    DROP CONSTRAINT outbox_events_event_type_check;
DROP INDEX outbox_events_shard_id;

-- Uniqueness on a partitioned table must include the partition key: ids come
-- from one identity sequence, and the batcher's event ids always belong to
-- one aggregate (outboxrelay_event_id hashes the source id), so for them
-- (event_id, aggregate_id) is as strict as event_id was. An application
-- that reuses one event id for two aggregates now gets two events.
CREATE TABLE outbox_events (
    id                bigint      GENERATED ALWAYS AS IDENTITY,
    event_id          uuid        NOT NULL,
    topic             text        NOT NULL,
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint      NOT NULL,
    event_type        text        NOT NULL CHECK (event_type <> ''),
    payload           jsonb,
    headers           jsonb       NOT NULL DEFAULT '{}',
    shard             smallint    NOT NULL GENERATED ALWAYS AS (outboxrelay_shard(aggregate_id)) STORED,
    xact_id           xid8        NOT NULL DEFAULT pg_current_xact_id(),
    created_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (id, aggregate_id),
    UNIQUE (event_id, aggregate_id)
) PARTITION BY HASH (aggregate_id);

DO $$
BEGIN
    FOR s IN 0..63 LOOP
        EXECUTE format(
            'CREATE TABLE %I PARTITION OF outbox_events (CONSTRAINT %I CHECK (shard = %s)) FOR VALUES WITH (MODULUS 64, REMAINDER %s)',
            'outbox_events_s' || lpad(s::text, 2, '0'), 'outbox_events_s' || lpad(s::text, 2, '0') || '_shard', s, s);
    END LOOP;
END $$;

INSERT INTO outbox_events (id, event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, xact_id, created_at)
OVERRIDING SYSTEM VALUE
SELECT id, event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, xact_id, created_at
FROM outbox_events_004;

-- The old table's privileges carry over, to the parent (writers insert
-- there) and to every partition (publishers name partitions directly, and
-- PostgreSQL checks a partition's own privileges when it is named).
DO $$
DECLARE
    acl record;
    t text;
BEGIN
    FOR acl IN
        SELECT a.privilege_type, a.grantee, a.is_grantable
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = 'outbox_events_004'::regclass AND a.grantee <> c.relowner
    LOOP
        FOREACH t IN ARRAY ARRAY['outbox_events'] || ARRAY(SELECT 'outbox_events_s' || lpad(s::text, 2, '0') FROM generate_series(0, 63) AS s) LOOP
            EXECUTE format('GRANT %s ON %I TO %s%s', acl.privilege_type, t,
                CASE WHEN acl.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(acl.grantee)) END,
                CASE WHEN acl.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
        END LOOP;
    END LOOP;
END $$;

SELECT setval(pg_get_serial_sequence('outbox_events', 'id'),
              greatest((SELECT max(id) FROM outbox_events_004), (SELECT last_value FROM outbox_events_004_id_seq), 1));

DROP TABLE outbox_events_004;

CREATE TRIGGER outbox_events_notify
AFTER INSERT ON outbox_events
REFERENCING NEW TABLE AS new_events
FOR EACH STATEMENT EXECUTE FUNCTION outboxrelay_outbox_notify();
