-- 019: event groups. One outbox row may carry many events of one shard: the
-- batcher writes a chunk's events as one row per shard instead of one row
-- per event (issue #31). A row costs PostgreSQL a heap tuple, an entry in
-- each index, a row in the NOTIFY trigger's transition table, the CHECKs,
-- and later a delete and its vacuum: per event that was about half of what
-- the batcher's chunk statement cost PostgreSQL.
--
-- A group row has group_ids set. Its members are, in order,
-- (group_ids[i], group_versions[i], group_event_ids[i], group_types[i]) with
-- the i-th element of payload, a JSON array (null for a delete); topic,
-- aggregate_type, headers and created_at are the members' own. aggregate_id
-- and event_id are the first member's, so the row is in its members' shard
-- (they all share it); event_type is 'group'. The publisher reads a group in
-- place of the row, member by member, and deletes the row once every member
-- is acknowledged (or dead-lettered, member by member). outbox_event_members
-- lists what is waiting one event per row, groups expanded.
-- Whether every id of a group is in shard s: a group's row lands in its
-- first member's shard (the partition's CHECK (shard = N)), and the shard's
-- publisher alone orders its keys.
-- Its search_path is the migration's: a SQL function's body is parsed at
-- each call, and a writer whose search_path lacks this schema (a logical
-- replication worker's is empty) would not find outboxrelay_shard.
CREATE FUNCTION outboxrelay_group_in_shard(ids text[], s smallint) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT
SET search_path FROM CURRENT
AS $$ SELECT bool_and(outboxrelay_shard(id) = s) FROM unnest(ids) AS id $$;

ALTER TABLE outbox_events
    ADD COLUMN group_ids       text[],
    ADD COLUMN group_versions  bigint[],
    ADD COLUMN group_event_ids uuid[],
    ADD COLUMN group_types     text[],
    -- What NOT NULL and the single-event CHECKs of 018 say, for each member
    -- (array_position finds a NULL, which would make the ALLs NULL and so
    -- pass), and that every member is in the row's shard. The upsert
    -- document check stays with the writer (the batcher quarantines a row
    -- whose document is not an object; a member whose payload is JSON null
    -- is sent without a value, as a single event's NULL payload).
    -- json_array_length reads the whole array once per group. All of it
    -- costs about 0.5 µs per member.
    ADD CONSTRAINT outbox_events_group_members CHECK (group_ids IS NULL OR (
        event_type = 'group'
        AND cardinality(group_ids) > 0
        AND cardinality(group_versions) = cardinality(group_ids)
        AND cardinality(group_event_ids) = cardinality(group_ids)
        AND cardinality(group_types) = cardinality(group_ids)
        AND array_position(group_ids, NULL) IS NULL AND array_position(group_versions, NULL) IS NULL
        AND array_position(group_event_ids, NULL) IS NULL AND array_position(group_types, NULL) IS NULL
        AND '' <> ALL (group_ids) AND 0 <= ALL (group_versions) AND '' <> ALL (group_types)
        AND outboxrelay_group_in_shard(group_ids, shard)
        AND json_typeof(payload) = 'array' AND json_array_length(payload) = cardinality(group_ids)
    )) NOT VALID;

-- A group's payload is tens of kilobytes, stored out of line: uncompressed,
-- since pglz cost the batcher more CPU than the smaller WAL saved (12%
-- more statement time in a 200,000-row run). A single event's payload under
-- about 2 kB is stored in its row, as before.
ALTER TABLE outbox_events ALTER COLUMN payload SET STORAGE EXTERNAL;

-- Retention keeps a published group as its row.
ALTER TABLE outbox_published
    ADD COLUMN group_ids       text[],
    ADD COLUMN group_versions  bigint[],
    ADD COLUMN group_event_ids uuid[],
    ADD COLUMN group_types     text[];

-- One row per waiting event, groups expanded in member order: for a look
-- at the outbox by hand (member is 0 for a single event's row, 1.. for a
-- group's members).
CREATE VIEW outbox_event_members AS
SELECT e.id, coalesce(g.n, 0)::int AS member,
       coalesce(g.event_id, e.event_id) AS event_id, e.topic, e.aggregate_type,
       coalesce(g.aggregate_id, e.aggregate_id) AS aggregate_id,
       coalesce(g.version, e.aggregate_version) AS aggregate_version,
       coalesce(g.type, e.event_type) AS event_type,
       CASE WHEN e.group_ids IS NULL THEN e.payload WHEN g.type = 'delete' THEN NULL ELSE g.payload END AS payload,
       e.headers, e.shard, e.xact_id, e.created_at
FROM outbox_events e
LEFT JOIN LATERAL ROWS FROM (
    unnest(e.group_ids), unnest(e.group_versions), unnest(e.group_event_ids), unnest(e.group_types),
    json_array_elements(CASE WHEN e.group_ids IS NOT NULL THEN e.payload END)
) WITH ORDINALITY AS g(aggregate_id, version, event_id, type, payload, n) ON true;

-- The partitions are renamed, outbox_events_s00 .. s63 becoming
-- outbox_events_shard_00 .. 63: a publisher from before this migration
-- reads and deletes them by name, and would send a group's row as one
-- message of type 'group' and delete it, its events lost to every consumer.
-- Renamed, its statements fail (relation "outbox_events_s00" does not
-- exist) and it sends nothing until it is replaced; writers insert through
-- outbox_events and are not affected. Constraint names and privileges stay.
DO $$
BEGIN
    FOR s IN 0..63 LOOP
        EXECUTE format('ALTER TABLE %I RENAME TO %I',
            'outbox_events_s' || lpad(s::text, 2, '0'), 'outbox_events_shard_' || lpad(s::text, 2, '0'));
    END LOOP;
END $$;

-- The publisher's read probes it for a waiting group: without one, a
-- shard is read without counting group members (outbox/sql.go, readSQL).
-- Single events are not in it.
CREATE INDEX outbox_events_groups ON outbox_events (id) WHERE group_ids IS NOT NULL;

-- Who may read outbox_events may read the view.
DO $$
DECLARE
    acl record;
BEGIN
    FOR acl IN
        SELECT a.grantee, a.is_grantable
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = 'outbox_events'::regclass AND a.grantee <> c.relowner AND a.privilege_type = 'SELECT'
    LOOP
        EXECUTE format('GRANT SELECT ON outbox_event_members TO %s%s',
            CASE WHEN acl.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(acl.grantee)) END,
            CASE WHEN acl.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END $$;
