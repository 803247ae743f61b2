package outbox_test

import (
	"context"
	"encoding/json"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// The trigger names the shards an INSERT touched, once per statement, and
// stays silent when ON CONFLICT DO NOTHING inserted nothing.
func TestNotifyNamesShards(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := stack.Database(t)
	pool := stack.Pool(t, url)
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = conn.Exec(ctx, "LISTEN outboxrelay_outbox")
	require.NoError(t, err)

	events := func(ids ...string) []outbox.Event {
		var out []outbox.Event
		for _, id := range ids {
			out = append(out, outbox.Event{ID: outbox.EventID("notify", id, 1, "v1"), Topic: "t", AggregateID: id, AggregateVersion: 1, Payload: json.RawMessage(`{}`)})
		}
		return out
	}
	shardsOf := func(ids ...string) []int {
		var out []int
		require.NoError(t, pool.QueryRow(ctx, `SELECT array_agg(DISTINCT outboxrelay_shard(id) ORDER BY outboxrelay_shard(id)) FROM unnest($1::text[]) AS id`, ids).Scan(&out))
		return out
	}
	next := func() []int {
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		n, err := conn.WaitForNotification(wctx)
		require.NoError(t, err)
		var got []int
		for f := range strings.SplitSeq(n.Payload, ",") {
			s, err := strconv.Atoi(f)
			require.NoError(t, err, "payload %q", n.Payload)
			got = append(got, s)
		}
		slices.Sort(got)
		return got
	}

	ids := []string{"a", "b", "c", "d", "e", "f", "a"}
	_, err = outbox.Enqueue(ctx, pool, events(ids...)...)
	require.NoError(t, err)
	require.Equal(t, shardsOf(ids...), next())

	// A replay inserts nothing and notifies nothing: the next notification
	// is the one of the insert after it.
	n, err := outbox.Enqueue(ctx, pool, events("a")...)
	require.NoError(t, err)
	require.Zero(t, n)
	_, err = outbox.Enqueue(ctx, pool, events("zz")...)
	require.NoError(t, err)
	require.Equal(t, shardsOf("zz"), next())
}

// With polling effectively off, a committed event reaches Kafka through the
// notification alone: the listener wakes the shard's worker directly.
func TestWakeFromNotificationWithoutPolling(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	brokers := stack.KafkaBrokers(t)
	pool := stack.Pool(t, stack.Database(t))
	topic := createTopic(t, brokers, 3)
	pub := startPublisher(t, pool, outbox.Config{Brokers: brokers, PollInterval: time.Hour})
	waitFor(t, 30*time.Second, "publisher to hold every shard", func() bool {
		var held int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_shard_leases WHERE owner = $1`, pub.ID()).Scan(&held))
		return held == outbox.NumShards
	})
	ev := outbox.Event{ID: outbox.EventID("wake", "42", 1, "v1"), Topic: topic, AggregateID: "42", AggregateVersion: 1, Payload: json.RawMessage(`{}`)}
	_, err := outbox.Enqueue(ctx, pool, ev)
	require.NoError(t, err)
	msgs := consumeAll(t, brokers, topic, map[string]bool{ev.ID: true}, time.Minute)
	require.Len(t, msgs, 1)
	waitFor(t, 30*time.Second, "outbox to drain", func() bool { return outboxCount(t, pool) == 0 })
}

// Without notifications (the trigger is off, as if every one were lost),
// polling alone finds the events: each PollInterval the publisher probes its
// idle shards' partitions and wakes the ones that hold events.
func TestPollingFindsEventsWithoutNotifications(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	brokers := stack.KafkaBrokers(t)
	pool := stack.Pool(t, stack.Database(t))
	topic := createTopic(t, brokers, 3)
	require.NoError(t, outbox.SetNotify(ctx, pool, false)) // `publisher notify off`
	on, err := outbox.NotifyEnabled(ctx, pool)
	require.NoError(t, err)
	require.False(t, on)
	pub := startPublisher(t, pool, outbox.Config{Brokers: brokers, PollInterval: 100 * time.Millisecond})
	waitFor(t, 30*time.Second, "publisher to hold every shard and find it empty", func() bool {
		var held int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_shard_leases WHERE owner = $1`, pub.ID()).Scan(&held))
		return held == outbox.NumShards
	})
	// Two rounds: the second one lands on shards whose workers went idle
	// after the first.
	for round := range 2 {
		insertEvents(t, pool, topic, 50, round*50, round*50+50, 10)
		msgs := consumeAll(t, brokers, topic, wantIDs(topic, 50, round*50, round*50+50), time.Minute)
		require.GreaterOrEqual(t, len(msgs), 50)
		waitFor(t, 30*time.Second, "outbox to drain", func() bool { return outboxCount(t, pool) == 0 })
	}
}
