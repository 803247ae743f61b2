package outbox

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

// readSQL reads the oldest unpublished events of one shard in id order. No
// watermark: published rows are gone, so an event that committed late (a
// lower id that became visible after higher ids were published) is simply the
// first row of the next read. See doc.go, "Commit order".
const readSQL = `
SELECT id, event_id::text, topic, aggregate_type, aggregate_id, aggregate_version, event_type,
       payload, headers, created_at
FROM outbox_events
WHERE shard = $1
ORDER BY id
LIMIT $2`

// leaseCTE checks that the shard is still held with the same epoch. It takes
// no row lock on purpose: heartbeats renew the lease rows all the time and
// must never queue behind these writes. A claim that slips in between the
// check and the commit costs duplicates only, never a loss: the rows deleted
// here were acknowledged by the broker.
const leaseCTE = `
WITH lease AS (
    SELECT 1 FROM outbox_shard_leases WHERE shard = $2 AND owner = $3 AND epoch = $4
)`

// deletePublishedSQL removes published events, fenced by the lease epoch.
// It returns whether the lease was still held and how many rows went.
const deletePublishedSQL = leaseCTE + `,
del AS (
    DELETE FROM outbox_events WHERE id = ANY($1::bigint[]) AND shard = $2 AND EXISTS (SELECT FROM lease)
    RETURNING 1
)
SELECT EXISTS (SELECT FROM lease), (SELECT count(*) FROM del)`

// retainPublishedSQL is deletePublishedSQL that keeps a copy in
// outbox_published for the retention period.
const retainPublishedSQL = leaseCTE + `,
del AS (
    DELETE FROM outbox_events WHERE id = ANY($1::bigint[]) AND shard = $2 AND EXISTS (SELECT FROM lease)
    RETURNING id, event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, shard, created_at
), ins AS (
    INSERT INTO outbox_published (id, event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, shard, created_at)
    SELECT * FROM del
    ON CONFLICT (id) DO NOTHING
)
SELECT EXISTS (SELECT FROM lease), (SELECT count(*) FROM del)`

// deadLetterSQL moves events the broker rejected for good into
// outbox_dead_letters with their error, fenced like deletePublishedSQL.
// $1 ids, $5 error texts, $6 error codes (0 = none).
const deadLetterSQL = leaseCTE + `,
moved AS (
    DELETE FROM outbox_events e
    USING unnest($1::bigint[], $5::text[], $6::int[]) AS d(id, error, code)
    WHERE e.id = d.id AND e.shard = $2 AND EXISTS (SELECT FROM lease)
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

// heartbeatSQL registers or renews this publisher and returns how many
// publishers are alive (this one included).
const heartbeatSQL = `
WITH me AS (
    INSERT INTO outbox_publishers (id, expires_at) VALUES ($1, now() + $2::interval)
    ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), expires_at = excluded.expires_at
    RETURNING id
)
SELECT 1 + count(*) FROM outbox_publishers WHERE expires_at > now() AND id <> $1`

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

// releaseLeaseSQL gives one shard back (after its worker stopped).
const releaseLeaseSQL = `
UPDATE outbox_shard_leases SET owner = NULL, expires_at = NULL
WHERE shard = $1 AND owner = $2 AND epoch = $3`

// leaveSQL removes this publisher at a clean stop, so the others rebalance
// at their next heartbeat instead of waiting for the lease TTL.
const leaveSQL = `DELETE FROM outbox_publishers WHERE id = $1`

// pendingShardsSQL is the polling fallback: which of my shards have events.
const pendingShardsSQL = `
SELECT l.shard FROM outbox_shard_leases l
WHERE l.owner = $1 AND EXISTS (SELECT FROM outbox_events e WHERE e.shard = l.shard)`

// backlogSQL feeds the backlog gauges.
const backlogSQL = `SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 FROM outbox_events`

// cleanupPublishedSQL deletes retained rows past the retention, a batch at a
// time so no statement holds many locks.
const cleanupPublishedSQL = `
DELETE FROM outbox_published WHERE id IN (
    SELECT id FROM outbox_published WHERE published_at < now() - $1::interval ORDER BY published_at LIMIT $2
)`
