package outbox_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
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
	for _, retention := range []time.Duration{0, time.Hour} {
		t.Run("retention "+retention.String(), func(t *testing.T) {
			t.Parallel()
			testEventGroups(t, retention)
		})
	}
}

func testEventGroups(t *testing.T, retention time.Duration) {
	ctx := context.Background()
	brokers := stack.KafkaBrokers(t)
	pool := stack.Pool(t, stack.Database(t))
	topic := createTopic(t, brokers, 3)
	const keys = 7
	// Single event g is key k<g%7>, version g/7+1 (1..10 before the
	// groups, 111..120 after them).
	insertEvents(t, pool, topic, keys, 0, 70, 100)
	// Then 700 events in groups, keys k0..k699 at version 100 (at most one
	// event per key in a statement: InsertEventGroupsSQL), about 3 kB each,
	// so a group is larger than BATCH_BYTES below; every tenth a delete.
	const big = 230 // one member over the broker's 1 MB, random so that lz4 cannot shrink it
	groups := outbox.InsertEventGroupsSQL(outbox.EventSelect{
		EventID:          `outboxrelay_event_id('test', key, 100, 'v1')`,
		Topic:            `$1::text`,
		AggregateType:    `'test'`,
		AggregateID:      `key`,
		AggregateVersion: `100`,
		EventType:        `CASE WHEN g % 10 = 3 THEN 'delete' ELSE 'upsert' END`,
		Payload: `CASE WHEN g % 10 = 3 THEN NULL WHEN g = ` + strconv.Itoa(big) + `
		  THEN json_build_object('g', g, 'blob', (SELECT string_agg(md5(random()::text || n), '') FROM generate_series(1, 40000) n))
		  ELSE json_build_object('g', g, 'pad', repeat('x', 3000)) END`,
		Headers: `'{"ce_processorversion": "v1"}'::jsonb`,
	}, `(SELECT g, 'k' || g AS key FROM generate_series(0, 699) AS g) s`)
	tag, err := pool.Exec(ctx, groups, topic)
	require.NoError(t, err)
	groupRows := tag.RowsAffected()
	require.Greater(t, groupRows, int64(40), "a group per shard")
	insertEvents(t, pool, topic, keys, 770, 840, 100)
	// A single event too large as well, after the groups.
	bigSingle := outbox.EventID("test", "k3", 1000, "v1")
	_, err = pool.Exec(ctx, `INSERT INTO outbox_events (event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload)
SELECT $2::uuid, $1, 'test', 'k3', 1000, 'upsert', json_build_object('blob', (SELECT string_agg(md5(random()::text || n), '') FROM generate_series(1, 40000) n))`, topic, bigSingle)
	require.NoError(t, err)

	var rows, members int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox_events), (SELECT count(*) FROM outbox_event_members)`).Scan(&rows, &members))
	require.Equal(t, []int64{70 + groupRows + 70 + 1, 841}, []int64{rows, members})
	st, err := outbox.Status(ctx, pool)
	require.NoError(t, err)
	require.EqualValues(t, 841, st.Backlog, "publisher status counts events")

	reg := prometheus.NewRegistry()
	startPublisher(t, pool, outbox.Config{Brokers: brokers, BatchBytes: 20_000, Registerer: reg, Retention: retention})
	want := wantIDs(topic, keys, 0, 70)
	maps.Copy(want, wantIDs(topic, keys, 770, 840))
	for g := range 700 {
		if g != big {
			want[outbox.EventID("test", "k"+strconv.Itoa(g), 100, "v1")] = true
		}
	}
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
	require.Len(t, want, 839)

	dls, err := outbox.ListDeadLetters(ctx, pool, 10)
	require.NoError(t, err)
	require.Len(t, dls, 2, "only the oversized member and the oversized single event")
	slices.SortFunc(dls, func(a, b outbox.DeadLetter) int { return strings.Compare(a.AggregateID, b.AggregateID) })
	require.Equal(t, outbox.EventID("test", "k"+strconv.Itoa(big), 100, "v1"), dls[0].EventID) // k230
	require.Equal(t, "k"+strconv.Itoa(big), dls[0].AggregateID)
	require.Greater(t, dls[0].PayloadBytes, 1_000_000, "its own payload, not the group's")
	require.Equal(t, bigSingle, dls[1].EventID) // k3
	require.Equal(t, 2.0, metricValue(t, reg, "outbox_dead_letters_total"))
	require.Equal(t, 839.0, metricValue(t, reg, "outbox_events_published_total"))

	var retained int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), coalesce(sum(coalesce(cardinality(group_ids), 1)), 0) FROM outbox_published`).Scan(&rows, &retained))
	if retention > 0 {
		require.Equal(t, []int64{70 + groupRows + 70, 840}, []int64{rows, retained}, "groups are retained as their rows (a dead member too), a dead single event is not")
	} else {
		require.Zero(t, rows)
	}

	// dead-letter retry puts them back as events of their own.
	n, err := outbox.RetryDeadLetters(ctx, pool, nil)
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	var keysBack []string
	require.NoError(t, pool.QueryRow(ctx, `SELECT array_agg(aggregate_id ORDER BY aggregate_id) FROM outbox_events WHERE group_ids IS NULL`).Scan(&keysBack))
	require.Equal(t, []string{"k" + strconv.Itoa(big), "k3"}, keysBack)
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

// outbox_events refuses an event group that the publisher could not send as
// events: a NULL among its members' columns (a single event's NOT NULL), a
// member outside the row's shard (whose order another shard's publisher
// keeps), arrays of different lengths. SQLSTATE 23514, the CHECK named.
func TestEventGroupCheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	var same, other string // an id in k0's shard, and one in another shard
	require.NoError(t, pool.QueryRow(ctx, `
SELECT (SELECT 'k' || g FROM generate_series(1, 1000) g WHERE outboxrelay_shard('k' || g) = outboxrelay_shard('k0') LIMIT 1),
       (SELECT 'k' || g FROM generate_series(1, 1000) g WHERE outboxrelay_shard('k' || g) <> outboxrelay_shard('k0') LIMIT 1)`).Scan(&same, &other))
	insert := func(ids []*string, versions []*int64, payload string) error {
		_, err := pool.Exec(ctx, `
INSERT INTO outbox_events (event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload,
                           group_ids, group_versions, group_event_ids, group_types)
SELECT gen_random_uuid(), 't', 'test', 'k0', 0, 'group', $3::json,
       $1::text[], $2::bigint[], array_fill(gen_random_uuid(), ARRAY[cardinality($1::text[])]), array_fill('upsert'::text, ARRAY[cardinality($1::text[])])`,
			ids, versions, payload)
		return err
	}
	k0, v1 := "k0", int64(1)
	for name, err := range map[string]error{
		"a NULL version":                 insert([]*string{&k0, &same}, []*int64{&v1, nil}, `[{}, {}]`),
		"a NULL id":                      insert([]*string{&k0, nil}, []*int64{&v1, &v1}, `[{}, {}]`),
		"a member in a shard of its own": insert([]*string{&k0, &other}, []*int64{&v1, &v1}, `[{}, {}]`),
		"fewer payloads":                 insert([]*string{&k0, &same}, []*int64{&v1, &v1}, `[{}]`),
		"no array":                       insert([]*string{&k0, &same}, []*int64{&v1, &v1}, `{}`),
	} {
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr, name)
		require.Equal(t, "23514", pgErr.Code, name)
		require.Equal(t, "outbox_events_group_members", pgErr.ConstraintName, name)
	}
	require.NoError(t, insert([]*string{&k0, &same}, []*int64{&v1, &v1}, `[{}, null]`), "a well-formed group")
}
