package outbox_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// Event groups (migration 019, written by outbox.InsertEventGroupsSQL) reach
// the topic event by event: between single events of the same keys, in
// order, deletes as tombstones, a member too large for the broker parked in
// outbox_dead_letters as an event of its own while the rest of its group is
// sent, and a BATCH_BYTES smaller than a group (a group is never split
// between two batches: its row is deleted once).
func TestPublishEventGroups(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	brokers := stack.KafkaBrokers(t)
	pool := stack.Pool(t, stack.Database(t))
	topic := createTopic(t, brokers, 3)
	const keys = 7
	// Event g is key k<g%7>, version g/7+1: a key's versions grow with g.
	insertEvents(t, pool, topic, keys, 0, 70, 100)
	const big = 300 // one member over the broker's 1 MB, random so that lz4 cannot shrink it
	groups := outbox.InsertEventGroupsSQL(outbox.EventSelect{
		EventID:          `outboxrelay_event_id('test', key, g / 7 + 1, 'v1')`,
		Topic:            `$1::text`,
		AggregateType:    `'test'`,
		AggregateID:      `key`,
		AggregateVersion: `g / 7 + 1`,
		EventType:        `CASE WHEN g % 10 = 3 THEN 'delete' ELSE 'upsert' END`,
		Payload: `CASE WHEN g % 10 = 3 THEN NULL WHEN g = ` + strconv.Itoa(big) + `
		  THEN json_build_object('g', g, 'blob', (SELECT string_agg(md5(random()::text || n), '') FROM generate_series(1, 40000) n))
		  ELSE json_build_object('g', g, 'pad', repeat('x', 300)) END`,
		Headers: `'{"ce_processorversion": "v1"}'::jsonb`,
	}, `(SELECT g, 'k' || (g % 7) AS key FROM generate_series($2::int, $3::int - 1) AS g) s`)
	tag, err := pool.Exec(ctx, groups, topic, 70, 770)
	require.NoError(t, err)
	require.EqualValues(t, keys, tag.RowsAffected(), "one group per shard of the 7 keys")
	insertEvents(t, pool, topic, keys, 770, 840, 100)

	var rows, members int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox_events), (SELECT count(*) FROM outbox_event_members)`).Scan(&rows, &members))
	require.Equal(t, []int64{70 + keys + 70, 840}, []int64{rows, members})
	st, err := outbox.Status(ctx, pool)
	require.NoError(t, err)
	require.EqualValues(t, 840, st.Backlog, "publisher status counts events")

	reg := prometheus.NewRegistry()
	startPublisher(t, pool, outbox.Config{Brokers: brokers, BatchBytes: 20_000, Registerer: reg, Retention: time.Hour})
	want := wantIDs(topic, keys, 0, 840)
	delete(want, outbox.EventID("test", "k"+strconv.Itoa(big%keys), big/keys+1, "v1"))
	msgs := consumeAll(t, brokers, topic, want, 2*time.Minute)
	checkOrder(t, msgs)
	waitFor(t, time.Minute, "the outbox to drain", func() bool { return outboxCount(t, pool) == 0 })

	tombstones := 0
	for _, m := range msgs {
		if m.value == nil {
			tombstones++
			continue
		}
		require.Contains(t, string(m.value), `"g"`, "an upsert carries its own document")
		require.NotContains(t, string(m.value), `},{`, "one document, not the group's array")
	}
	require.GreaterOrEqual(t, tombstones, 70, "every tenth group member is a delete")

	dls, err := outbox.ListDeadLetters(ctx, pool, 10)
	require.NoError(t, err)
	require.Len(t, dls, 1, "only the oversized member")
	require.Equal(t, outbox.EventID("test", "k"+strconv.Itoa(big%keys), big/keys+1, "v1"), dls[0].EventID)
	require.Equal(t, "k"+strconv.Itoa(big%keys), dls[0].AggregateID)
	require.Greater(t, dls[0].PayloadBytes, 1_000_000, "its own payload, not the group's")
	require.Equal(t, 1.0, metricValue(t, reg, "outbox_dead_letters_total"))
	require.Equal(t, 839.0, metricValue(t, reg, "outbox_events_published_total"))

	var retained int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), sum(coalesce(cardinality(group_ids), 1)) FROM outbox_published`).Scan(&rows, &retained))
	require.Equal(t, []int64{70 + keys + 70, 840}, []int64{rows, retained}, "groups are retained as their rows")

	// dead-letter retry puts the member back as an event of its own.
	n, err := outbox.RetryDeadLetters(ctx, pool, nil)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	var key string
	require.NoError(t, pool.QueryRow(ctx, `SELECT aggregate_id FROM outbox_events WHERE group_ids IS NULL`).Scan(&key))
	require.Equal(t, "k"+strconv.Itoa(big%keys), key)
}

// A publisher from before migration 019 named the shards' partitions
// outbox_events_s00 .. s63 in its reads and deletes. It would send an event
// group's row as one message and delete it, so 019 renames them: its
// statements now fail and it sends nothing (SQLSTATE 42P01).
func TestPublisherBeforeEventGroupsCannotRead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	insertEvents(t, pool, "t", 64, 0, 640, 10)
	var total int64
	for shard := range outbox.NumShards {
		_, err := pool.Exec(ctx, `SELECT id, event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type,
       payload, headers, created_at FROM outbox_events_s`+fmt.Sprintf("%02d", shard)+` ORDER BY id LIMIT 2000`)
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr, "shard %d", shard)
		require.Equal(t, "42P01", pgErr.Code, "shard %d: undefined table", shard)
		var n int64
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+outbox.ShardTable(shard)).Scan(&n))
		total += n
	}
	require.EqualValues(t, 640, total, "the new names hold the events")
}
