package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DB is what the admin functions need: a *pgxpool.Pool, *pgx.Conn or pgx.Tx.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// ShardStatus is one line of [Status]: a shard's backlog and its lease.
type ShardStatus struct {
	Shard          int
	Backlog        int64
	OldestAge      time.Duration // 0 when the shard is empty
	Owner          string        // "" when free
	Epoch          int64
	LeaseExpiresIn time.Duration // negative when expired
}

// PublisherStatus is one registered publisher.
type PublisherStatus struct {
	ID          string
	StartedAt   time.Time
	HeartbeatAt time.Time
	Alive       bool
	Shards      int
}

// StatusReport is what `publisher status` prints; it reads only the
// database, the source of truth.
type StatusReport struct {
	Shards      []ShardStatus
	Publishers  []PublisherStatus
	Backlog     int64
	OldestAge   time.Duration
	DeadLetters int64
	Retained    int64
}

const statusShardsSQL = `
SELECT l.shard, coalesce(b.n, 0), coalesce(extract(epoch FROM now() - b.oldest), 0)::float8,
       coalesce(l.owner, ''), l.epoch, coalesce(extract(epoch FROM l.expires_at - now()), 0)::float8
FROM outbox_shard_leases l
LEFT JOIN (SELECT shard, sum(coalesce(cardinality(group_ids), 1)) AS n, min(created_at) AS oldest FROM outbox_events GROUP BY shard) b ON b.shard = l.shard
ORDER BY l.shard`

const statusPublishersSQL = `
SELECT p.id, p.started_at, p.heartbeat_at, p.expires_at > now(),
       (SELECT count(*) FROM outbox_shard_leases l WHERE l.owner = p.id AND l.expires_at > now())
FROM outbox_publishers p ORDER BY p.id`

// Status reads backlog per shard, leases, publishers and dead letters.
func Status(ctx context.Context, q DB) (*StatusReport, error) {
	r := &StatusReport{}
	rows, err := q.Query(ctx, statusShardsSQL)
	if err != nil {
		return nil, fmt.Errorf("status: shards: %w", err)
	}
	r.Shards, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (ShardStatus, error) {
		var s ShardStatus
		var shard int16
		var age, exp float64
		err := row.Scan(&shard, &s.Backlog, &age, &s.Owner, &s.Epoch, &exp)
		s.Shard, s.OldestAge, s.LeaseExpiresIn = int(shard), seconds(age), seconds(exp)
		return s, err
	})
	if err != nil {
		return nil, fmt.Errorf("status: shards: %w", err)
	}
	for _, s := range r.Shards {
		r.Backlog += s.Backlog
		r.OldestAge = max(r.OldestAge, s.OldestAge)
	}
	rows, err = q.Query(ctx, statusPublishersSQL)
	if err != nil {
		return nil, fmt.Errorf("status: publishers: %w", err)
	}
	r.Publishers, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (PublisherStatus, error) {
		var s PublisherStatus
		err := row.Scan(&s.ID, &s.StartedAt, &s.HeartbeatAt, &s.Alive, &s.Shards)
		return s, err
	})
	if err != nil {
		return nil, fmt.Errorf("status: publishers: %w", err)
	}
	if err := q.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox_dead_letters), (SELECT count(*) FROM outbox_published)`).Scan(&r.DeadLetters, &r.Retained); err != nil {
		return nil, fmt.Errorf("status: dead letters: %w", err)
	}
	return r, nil
}

func seconds(f float64) time.Duration {
	return time.Duration(f * float64(time.Second)).Round(time.Millisecond)
}

// DeadLetter is one row of outbox_dead_letters.
type DeadLetter struct {
	ID               int64
	EventID          string
	Topic            string
	AggregateID      string
	AggregateVersion int64
	EventType        string
	PayloadBytes     int
	Error            string
	ErrorCode        *int32
	FailedAt         time.Time
}

// ListDeadLetters returns up to limit dead letters, oldest first.
func ListDeadLetters(ctx context.Context, q DB, limit int) ([]DeadLetter, error) {
	rows, err := q.Query(ctx, `
SELECT id, event_id::text, topic, aggregate_id, aggregate_version, event_type, coalesce(octet_length(payload::text), 0),
       error, error_code, failed_at
FROM outbox_dead_letters ORDER BY id LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (DeadLetter, error) {
		var d DeadLetter
		err := row.Scan(&d.ID, &d.EventID, &d.Topic, &d.AggregateID, &d.AggregateVersion, &d.EventType, &d.PayloadBytes, &d.Error, &d.ErrorCode, &d.FailedAt)
		return d, err
	})
}

// retryDeadLettersSQL puts dead letters back into the outbox (a new id, so
// they are published after what is already queued for their shard). An
// event id still in the outbox is not duplicated.
const retryDeadLettersSQL = `
WITH moved AS (
    DELETE FROM outbox_dead_letters WHERE ($1::bigint[] IS NULL OR id = ANY($1))
    RETURNING id, event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers
)
INSERT INTO outbox_events (event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers)
SELECT event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers FROM moved ORDER BY id
ON CONFLICT DO NOTHING`

// RetryDeadLetters moves the given dead letters (all of them when ids is
// nil) back into outbox_events, in one statement, and returns how many were
// re-enqueued.
func RetryDeadLetters(ctx context.Context, q DB, ids []int64) (int64, error) {
	tag, err := q.Exec(ctx, retryDeadLettersSQL, ids)
	if err != nil {
		return 0, fmt.Errorf("retry dead letters: %w", err)
	}
	return tag.RowsAffected(), nil
}

// SetNotify turns the outbox's NOTIFY trigger on or off. On (the default),
// every transaction that writes the outbox NOTIFYs the publishers at
// commit, so idle shards wake at once; but NOTIFY takes PostgreSQL's global
// notify lock from the commit until it is flushed, which serialises the
// commits of every writer of the outbox (16 concurrent writers: see
// bench/publisher, "writers"). Off, writers commit without it and
// publishers find idle shards by polling every Config.PollInterval (a busy
// shard never waits: it reads its next batch at once). Publishers notice
// at their next start; running ones keep LISTENing and simply get no more
// notifications.
func SetNotify(ctx context.Context, q DB, on bool) error {
	sql := disableNotifySQL
	if on {
		sql = enableNotifySQL
	}
	if _, err := q.Exec(ctx, sql); err != nil {
		return fmt.Errorf("turn the outbox NOTIFY trigger %s: %w", onOff(on), err)
	}
	return nil
}

// NotifyEnabled reports whether the outbox's NOTIFY trigger is on.
func NotifyEnabled(ctx context.Context, q DB) (bool, error) { return notifyEnabled(ctx, q) }

func notifyEnabled(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (bool, error) {
	var on bool
	if err := q.QueryRow(ctx, notifyEnabledSQL).Scan(&on); err != nil {
		return false, fmt.Errorf("read the outbox NOTIFY trigger: %w", err)
	}
	return on, nil
}

func onOff(on bool) string {
	if on {
		return "on"
	}
	return "off"
}
