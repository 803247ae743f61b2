package outbox

import (
	"fmt"
	"strings"
)

// The publisher's SQL, in one place. Tables: outbox_events (001),
// outbox_publishers, outbox_shard_leases, outbox_published and
// outbox_dead_letters (004).

// NumShards is the number of outbox shards (outboxrelay_shard in 001).
const NumShards = 64

// notifyChannel is the channel the outbox_events_notify trigger signals;
// the payload lists the shards the INSERT touched ("3,17,42").
const notifyChannel = "outboxrelay_outbox"

// membersChannel carries membership changes between publishers: a publisher
// that joins, gives shards back or stops says so, and the others rebalance
// at once instead of at their next heartbeat.
const membersChannel = "outboxrelay_publishers"

// membersChangedSQL announces a membership change on membersChannel.
const membersChangedSQL = `SELECT pg_notify('` + membersChannel + `', $1)`

// asyncCommitSQL makes the transaction that records a batch commit without
// waiting for its WAL flush. Safe here because the broker already has the
// events: a database crash that loses the commit puts them back in the
// outbox and they are sent again, a duplicate and never a loss. Every shard
// round trip then costs one network hop instead of one plus an fsync.
const asyncCommitSQL = `SELECT set_config('synchronous_commit', 'off', true)`

// shardTable is where the statements below name a shard's partition
// (outbox_events_shard_00 .. _63, migrations 005 and 019): each shard worker
// reads and deletes its own partition directly, so PostgreSQL touches that
// shard's pages only. Inserts go through outbox_events.
const shardTable = "{shard_table}"

// ShardTable is the partition of outbox_events that holds shard's events.
func ShardTable(shard int) string { return fmt.Sprintf("outbox_events_shard_%02d", shard) }

// shardStatements are one shard's statements, with its partition named.
type shardStatements struct {
	read, delete, retain, deadLetter, deadMembers string
}

var shardSQL = func() (out [NumShards]shardStatements) {
	for s := range out {
		name := func(sql string) string { return strings.ReplaceAll(sql, shardTable, ShardTable(s)) }
		out[s] = shardStatements{
			read:        name(readSQL),
			delete:      name(deletePublishedSQL),
			retain:      name(retainPublishedSQL),
			deadLetter:  name(deadLetterSQL),
			deadMembers: name(deadMembersSQL),
		}
	}
	return out
}()

// readSQL reads the oldest unpublished events of one shard in id order. No
// watermark: published rows are gone, so an event that committed late (a
// lower id that became visible after higher ids were published) is simply the
// first row of the next read. See doc.go, "Commit order". event_id comes
// as the uuid's 16 bytes, formatted by the publisher (eventIDText).
//
// $1 counts rows, and $2 the event groups (migration 019) among them: a
// group holds up to about GroupBytes of events, and the publisher expands
// it (scanEvents), so a read keeps at most $2 + 1 of them: the rows up to
// the ($2+1)-th group's id, found in the partial index outbox_events_groups
// (empty, and one probe, while no group waits). The filter is outside the
// LIMIT on purpose: inside, the planner estimates that it keeps a third of
// the shard and reads the whole partition and sorts it (EXPLAIN of a custom
// plan over 3,229 rows); outside, the plan is the index scan of a plain
// read, whose rows past the bound are dropped before their payloads are
// read.
const readSQL = `
SELECT * FROM (
    SELECT id, event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type,
           payload, headers, created_at, group_ids, group_versions, group_event_ids, group_types
    FROM ` + shardTable + `
    ORDER BY id
    LIMIT $1
) r
WHERE id <= coalesce((SELECT id FROM ` + shardTable + ` WHERE group_ids IS NOT NULL ORDER BY id OFFSET $2 LIMIT 1), 9223372036854775807)
ORDER BY id`

// leaseCTE checks that the shard is still held with the same epoch. It takes
// no row lock on purpose: heartbeats renew the lease rows all the time and
// must never queue behind these writes. A claim that slips in between the
// check and the commit costs duplicates only, never a loss: the rows deleted
// here were acknowledged by the broker.
const leaseCTE = `
WITH lease AS (
    SELECT 1 FROM outbox_shard_leases WHERE shard = $2 AND owner = $3 AND epoch = $4
)`

// publishedRows are the rows a batch published: exactly the ids sent and
// acknowledged ($1); each statement that uses it adds the lease fence. The delete never relies on what
// a row says about itself (such as xact_id), so no row can go without
// having been sent. $5 and $6 are the lowest and highest of the ids: the
// index serves that range in one pass over the batch's pages and the ids
// are a hashed filter on it ("id + 0" keeps the planner from turning them
// into one index descent per id), a third of the time of the lookups.
const publishedRows = `id BETWEEN $5 AND $6 AND id + 0 = ANY($1::bigint[])`

// deletePublishedSQL removes published events, fenced by the lease epoch;
// leaseHeldSQL, the statement after it, says whether the lease was still
// held. A plain DELETE and not a CTE with RETURNING like the two below:
// RETURNING makes PostgreSQL fetch every deleted row again to project it,
// a second buffer access per event (2,493 buffer hits against 1,293 for
// 1,200 events, EXPLAIN ANALYZE), and the count it would give is the
// command tag's. The lease row can only stop matching, never start again
// (a claim takes a new epoch), so a lease held at the check was held at the
// delete; one lost in between costs nothing either: the rows deleted were
// acknowledged by the broker.
const deletePublishedSQL = `
DELETE FROM ` + shardTable + ` WHERE ` + publishedRows + `
  AND EXISTS (SELECT FROM outbox_shard_leases WHERE shard = $2 AND owner = $3 AND epoch = $4)`

// leaseHeldSQL reports whether the shard is still held with the same epoch.
const leaseHeldSQL = `SELECT EXISTS (SELECT FROM outbox_shard_leases WHERE shard = $1 AND owner = $2 AND epoch = $3)`

// retainPublishedSQL is deletePublishedSQL that keeps a copy in
// outbox_published for the retention period.
const retainPublishedSQL = leaseCTE + `,
del AS (
    DELETE FROM ` + shardTable + ` WHERE ` + publishedRows + ` AND EXISTS (SELECT FROM lease)
    RETURNING id, event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, shard, created_at,
              group_ids, group_versions, group_event_ids, group_types
), ins AS (
    INSERT INTO outbox_published (id, event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, shard, created_at,
                                  group_ids, group_versions, group_event_ids, group_types)
    SELECT * FROM del
    ON CONFLICT (id) DO NOTHING
)
SELECT EXISTS (SELECT FROM lease), (SELECT count(*) FROM del)`

// deadLetterSQL moves events the broker rejected for good into
// outbox_dead_letters with their error, fenced like deletePublishedSQL.
// $1 ids, $5 error texts, $6 error codes (0 = none).
const deadLetterSQL = leaseCTE + `,
moved AS (
    DELETE FROM ` + shardTable + ` e
    USING unnest($1::bigint[], $5::text[], $6::int[]) AS d(id, error, code)
    WHERE e.id = d.id AND EXISTS (SELECT FROM lease)
    RETURNING e.id, e.event_id, e.topic, e.aggregate_type, e.aggregate_id, e.aggregate_version, e.event_type,
              e.payload, e.headers, e.shard, e.created_at, d.error, d.code
), ins AS (
    INSERT INTO outbox_dead_letters (outbox_id, event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type,
                                     payload, headers, shard, created_at, error, error_code)
    SELECT id, event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type,
           payload, headers, shard, created_at, error, nullif(code, 0)
    FROM moved
)
SELECT EXISTS (SELECT FROM lease), (SELECT count(*) FROM moved)`

// deadMembersSQL parks members of event groups the broker rejected for good
// in outbox_dead_letters, each as an event of its own (outbox_id is the
// group's row), and deletes their groups' rows, fenced like deadLetterSQL:
// one statement, so the lease is checked once for both (a lease lost in
// between would leave the dead letters written and the group to be sent,
// and its dead member parked, once more). Under a retention ($8) the row
// is also kept in outbox_published, as written: its dead members too.
// $1 row ids, $5 error texts, $6 error codes (0 = none), $7 members (1..).
const deadMembersSQL = leaseCTE + `,
del AS (
    DELETE FROM ` + shardTable + ` WHERE id = ANY($1::bigint[]) AND EXISTS (SELECT FROM lease)
    RETURNING id, event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, shard, created_at,
              group_ids, group_versions, group_event_ids, group_types
), moved AS (
    INSERT INTO outbox_dead_letters (outbox_id, event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type,
                                     payload, headers, shard, created_at, error, error_code)
    SELECT e.id, e.group_event_ids[d.member], e.topic, e.aggregate_type, e.group_ids[d.member], e.group_versions[d.member], e.group_types[d.member],
           CASE WHEN e.group_types[d.member] <> 'delete' THEN nullif((e.payload -> (d.member - 1))::text, 'null')::json END,
           e.headers, e.shard, e.created_at, d.error, nullif(d.code, 0)
    FROM del e
    JOIN unnest($1::bigint[], $5::text[], $6::int[], $7::int[]) AS d(id, error, code, member) ON e.id = d.id
    RETURNING 1
), kept AS (
    INSERT INTO outbox_published (id, event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, shard, created_at,
                                  group_ids, group_versions, group_event_ids, group_types)
    SELECT * FROM del WHERE $8::boolean
    ON CONFLICT (id) DO NOTHING
)
SELECT EXISTS (SELECT FROM lease), (SELECT count(*) FROM moved)`

// notifyTrigger is the statement-level trigger on outbox_events that
// NOTIFYs notifyChannel (migration 004, recreated by 005).
const notifyTrigger = "outbox_events_notify"

// notifyEnabledSQL reports whether the NOTIFY trigger fires ('D' is
// disabled; a missing trigger does not fire either).
const notifyEnabledSQL = `SELECT coalesce((SELECT tgenabled <> 'D' FROM pg_trigger WHERE tgrelid = 'outbox_events'::regclass AND tgname = '` + notifyTrigger + `'), false)`

// enableNotifySQL and disableNotifySQL switch the trigger (they take a
// short SHARE ROW EXCLUSIVE lock on outbox_events, which waits for the
// writers in flight).
const (
	enableNotifySQL  = `ALTER TABLE outbox_events ENABLE TRIGGER ` + notifyTrigger
	disableNotifySQL = `ALTER TABLE outbox_events DISABLE TRIGGER ` + notifyTrigger
)

// idCacheSQL reads the CACHE of outbox_events' identity sequence (see
// checkIDSequence).
const idCacheSQL = `SELECT seqcache FROM pg_sequence WHERE seqrelid = pg_get_serial_sequence('outbox_events', 'id')::regclass`

// heartbeatSQL registers or renews this publisher instance ($3) and
// returns whether it holds its id and how many publishers are alive (this
// one included). The id is not this instance's while another instance's
// membership under it has not expired: a second process started with the
// same id is then refused, and the first keeps its shards.
const heartbeatSQL = `
WITH me AS (
    INSERT INTO outbox_publishers AS p (id, instance, expires_at) VALUES ($1, $3, now() + $2::interval)
    ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), expires_at = excluded.expires_at, instance = excluded.instance,
                                   started_at = CASE WHEN p.instance = excluded.instance THEN p.started_at ELSE now() END
    WHERE p.instance = excluded.instance OR p.expires_at <= now()
    RETURNING id
)
SELECT EXISTS (SELECT FROM me), 1 + count(*) FROM outbox_publishers WHERE expires_at > now() AND id <> $1`

// publisherInstanceSQL names the instance holding an id and how long its
// membership still runs.
const publisherInstanceSQL = `SELECT instance, greatest(expires_at - now(), '0'::interval) FROM outbox_publishers WHERE id = $1`

// forgetDeadPublishersSQL drops members that have not beaten for a while, so
// status does not list them forever.
const forgetDeadPublishersSQL = `DELETE FROM outbox_publishers WHERE expires_at < now() - $1::interval`

// renewLeasesSQL extends every lease this publisher holds and returns them.
// A lease that expired but was not claimed by anyone is still ours: nobody
// else has sent from the shard meanwhile.
const renewLeasesSQL = `
UPDATE outbox_shard_leases SET expires_at = now() + $2::interval
WHERE owner = $1
RETURNING shard, epoch`

// claimLeasesSQL takes up to $3 free or expired shards with a new epoch.
// SKIP LOCKED: publishers claiming at the same moment take different shards.
const claimLeasesSQL = `
UPDATE outbox_shard_leases l
SET owner = $1, epoch = l.epoch + 1, expires_at = now() + $2::interval, acquired_at = now()
FROM (
    SELECT shard FROM outbox_shard_leases
    WHERE owner IS NULL OR expires_at < now()
    ORDER BY shard
    LIMIT $3
    FOR UPDATE SKIP LOCKED
) free
WHERE l.shard = free.shard
RETURNING l.shard, l.epoch`

// releaseLeaseSQL gives one shard back (after its worker stopped), while
// this instance ($4) still holds the id: a lease is fenced by (id, epoch),
// and a second process that took the id over after this one stalled past
// its TTL renewed the id's leases at the same epochs and sends from them.
// FOR SHARE orders the release with that process's heartbeat, which
// updates the membership row before it renews the leases.
const releaseLeaseSQL = `
UPDATE outbox_shard_leases SET owner = NULL, expires_at = NULL
WHERE shard = $1 AND owner = $2 AND epoch = $3
  AND EXISTS (SELECT FROM outbox_publishers WHERE id = $2 AND instance = $4 FOR SHARE)`

// leaveSQL removes this publisher at a clean stop, so the others rebalance
// at their next heartbeat instead of waiting for the lease TTL.
const leaveSQL = `DELETE FROM outbox_publishers WHERE id = $1 AND instance = $2`

// pendingShardsSQL is the polling fallback: which of the shards $1 (this
// publisher's idle ones) have events. One index probe per partition (the
// first id), since the partition key is not the shard and PostgreSQL cannot
// prune on it. The CASE makes each probe run only for a shard asked about
// (a plain AND may be evaluated in either order).
var pendingShardsSQL = perShard(`
SELECT %[2]d::smallint AS shard WHERE CASE WHEN %[2]d = ANY($1::smallint[]) THEN (SELECT id FROM %[1]s ORDER BY id LIMIT 1) IS NOT NULL END`,
	"\nUNION ALL")

// backlogSQL feeds the backlog gauges, cheaply enough to run every few
// seconds in every publisher whatever the backlog. Each partition gets one
// index probe for its first row by id: none means the shard is empty and
// counts 0, exactly; otherwise the count is PostgreSQL's live-row
// statistics for the partition (committed inserts and deletes as sessions
// report them, within about a second, and reset to an estimate by VACUUM
// and ANALYZE, so it may be off by a little until the shard empties;
// `publisher status` counts exactly). The oldest event is the oldest first
// row. A count(*) would read every waiting event: a quarter of a second of
// database time per publisher for 200,000 events, minutes for a large
// backfill. An event group (migration 019) is one row of many events: a
// shard's rows count as many events each as its first 16 rows hold on
// average: close while a first load's groups wait (they are alike in
// size); a group ahead of many single events inflates it until the group
// is sent, and `publisher status` counts exactly.
var backlogSQL = `
SELECT coalesce(sum(CASE WHEN p.first IS NULL THEN 0 ELSE round(greatest(s.n_live_tup, 1) * p.members) END), 0)::bigint,
       coalesce(extract(epoch FROM now() - min(p.first)), 0)::float8
FROM (VALUES ` + perShard(`
    ('%[1]s'::regclass, (SELECT created_at FROM %[1]s ORDER BY id LIMIT 1),
     (SELECT avg(coalesce(cardinality(group_ids), 1)) FROM (SELECT group_ids FROM %[1]s ORDER BY id LIMIT 16) f))`, ",") + `
) AS p(rel, first, members)
LEFT JOIN pg_stat_all_tables s ON s.relid = p.rel`

// perShard repeats format for every shard, joined by sep: %[1]s in it is
// the shard's partition, %[2]d the shard.
func perShard(format, sep string) string {
	parts := make([]string, NumShards)
	for s := range parts {
		parts[s] = fmt.Sprintf(format, ShardTable(s), s)
	}
	return strings.Join(parts, sep)
}

// cleanupPublishedSQL deletes retained rows past the retention, a batch at a
// time so no statement holds many locks.
const cleanupPublishedSQL = `
DELETE FROM outbox_published WHERE id IN (
    SELECT id FROM outbox_published WHERE published_at < now() - $1::interval ORDER BY published_at LIMIT $2
)`
