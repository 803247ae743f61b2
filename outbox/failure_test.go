package outbox_test

import (
	"context"
	cryptorand "crypto/rand"
	"encoding/base64"
	"encoding/json"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/metrics"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// Transaction A enqueues an event (a lower id) and stays open while B
// enqueues later events that get published; once A commits, its event is
// published too: no "highest id seen" watermark skips it.
func TestPublishLateCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	brokers := stack.KafkaBrokers(t)
	pool := stack.Pool(t, stack.Database(t))
	topic := createTopic(t, brokers, 3)
	ev := func(key string, v int64) outbox.Event {
		return outbox.Event{ID: outbox.EventID("late", key, v, "v1"), Topic: topic, AggregateID: key, AggregateVersion: v, Payload: json.RawMessage(`{}`)}
	}
	a, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer a.Rollback(ctx)
	lateEv := ev("a", 1)
	_, err = outbox.Enqueue(ctx, a, lateEv)
	require.NoError(t, err)
	var aID int64
	require.NoError(t, a.QueryRow(ctx, `SELECT id FROM outbox_events WHERE event_id = $1`, lateEv.ID).Scan(&aID))

	var published atomic.Int64
	startPublisher(t, pool, outbox.Config{Brokers: brokers, OnPublished: func(_ int, evs []outbox.Published) { published.Add(int64(len(evs))) }})
	var later []outbox.Event
	for i := range 20 {
		later = append(later, ev("b"+string(rune('a'+i)), 1))
	}
	// B's ids are read before B commits: the running publisher may send
	// and delete them at once.
	b, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer b.Rollback(ctx)
	_, err = outbox.Enqueue(ctx, b, later...)
	require.NoError(t, err)
	var minLater int64
	require.NoError(t, b.QueryRow(ctx, `SELECT min(id) FROM outbox_events`).Scan(&minLater))
	require.Greater(t, minLater, aID, "B's events have higher ids than A's")
	require.NoError(t, b.Commit(ctx))
	waitFor(t, time.Minute, "B's events to be published", func() bool { return published.Load() == int64(len(later)) })

	require.NoError(t, a.Commit(ctx))
	want := map[string]bool{lateEv.ID: true}
	for _, e := range later {
		want[e.ID] = true
	}
	consumeAll(t, brokers, topic, want, time.Minute)
	waitFor(t, 30*time.Second, "the outbox to drain", func() bool { return outboxCount(t, pool) == 0 })
}

// An event larger than the broker accepts goes to outbox_dead_letters with
// the error; the events around it, on the same key too, are published.
func TestPublishTooLargeGoesToDeadLetters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	brokers := stack.KafkaBrokers(t)
	pool := stack.Pool(t, stack.Database(t))
	topic := createTopic(t, brokers, 3)
	// Random, so that compression (COMPRESSION, lz4 by default) does not
	// bring it under the broker's 1 MB limit.
	blob := make([]byte, 1_500_000)
	_, _ = cryptorand.Read(blob)
	big := `{"blob":"` + base64.StdEncoding.EncodeToString(blob) + `"}`
	var evs []outbox.Event
	for v := int64(1); v <= 5; v++ {
		payload := json.RawMessage(`{"v":1}`)
		if v == 3 {
			payload = json.RawMessage(big)
		}
		evs = append(evs, outbox.Event{ID: outbox.EventID("big", "k", v, "v1"), Topic: topic, AggregateID: "k", AggregateVersion: v, Payload: payload})
	}
	for _, tc := range []struct {
		name       string
		batchBytes int // above the broker's limit: the broker itself rejects it
	}{
		{name: "refused before sending", batchBytes: 0},
		{name: "rejected by the broker", batchBytes: 4_000_000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			_, err := pool.Exec(ctx, `TRUNCATE outbox_dead_letters, outbox_published, outbox_events`)
			require.NoError(t, err)
			_, err = outbox.Enqueue(ctx, pool, evs...)
			require.NoError(t, err)
			runCtx, cancel := context.WithCancel(ctx)
			pub, err := outbox.NewPublisher(pool, outbox.Config{Brokers: brokers, BatchBytes: tc.batchBytes, Registerer: reg,
				LeaseTTL: 2 * time.Second, Retention: time.Hour, Logger: testLogger()})
			require.NoError(t, err)
			done := make(chan error, 1)
			go func() { done <- pub.Run(runCtx) }()
			waitFor(t, time.Minute, "the outbox to drain", func() bool { return outboxCount(t, pool) == 0 })
			cancel()
			require.NoError(t, <-done)

			dls, err := outbox.ListDeadLetters(ctx, pool, 10)
			require.NoError(t, err)
			require.Len(t, dls, 1)
			require.Equal(t, evs[2].ID, dls[0].EventID)
			require.NotNil(t, dls[0].ErrorCode)
			require.EqualValues(t, 10, *dls[0].ErrorCode, "MESSAGE_TOO_LARGE")
			require.Contains(t, dls[0].Error, "Message Size Too Large")
			require.Equal(t, 1.0, metricValue(t, reg, "outbox_dead_letters_total"))
			var retained int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_published`).Scan(&retained))
			require.Equal(t, 4, retained, "published events are retained, not in the outbox")
		})
	}
	want := map[string]bool{}
	for i, e := range evs {
		if i != 2 {
			want[e.ID] = true
		}
	}
	msgs := consumeAll(t, brokers, topic, want, time.Minute)
	checkOrder(t, msgs)

	// dead-letter retry puts it back into the outbox.
	n, err := outbox.RetryDeadLetters(ctx, pool, nil)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	require.EqualValues(t, 1, outboxCount(t, pool))
}

// metricValue reads a counter or gauge from reg.
func metricValue(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			m := mf.GetMetric()[0]
			if m.Counter != nil {
				return m.Counter.GetValue()
			}
			return m.Gauge.GetValue()
		}
	}
	t.Fatalf("metric %s not registered", name)
	return 0
}

// Kafka stops for 30 s mid-stream and starts again: nothing is lost, order
// holds, health is degraded meanwhile, and the backlog gauge rises and falls.
func TestPublishSurvivesKafkaOutage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	kafkaSrv := stack.Private(t, "kafka")
	brokers := strings.Split(kafkaSrv.Env, ",")
	pool := stack.Pool(t, stack.Database(t))
	topic := createTopic(t, brokers, 3)
	const keys = 50
	reg := prometheus.NewRegistry()
	health := metrics.NewHealth()
	startPublisher(t, pool, outbox.Config{Brokers: brokers, Registerer: reg, Health: health, BacklogInterval: 200 * time.Millisecond,
		WriteTimeout: 2 * time.Second, RetryMaxElapsed: 10 * time.Second})
	backlog := func() float64 { return metricValue(t, reg, "outbox_backlog_events") }

	next := 0
	write := func(n int) {
		insertEvents(t, pool, topic, keys, next, next+n, 100)
		next += n
	}
	write(500)
	waitFor(t, time.Minute, "the first events to be published", func() bool { return outboxCount(t, pool) == 0 })

	require.NoError(t, kafkaSrv.Stop())
	outageEnd := time.Now().Add(30 * time.Second)
	var peak float64
	for time.Now().Before(outageEnd) {
		write(100)
		peak = max(peak, backlog())
		time.Sleep(500 * time.Millisecond) // the outage lasts 30 s of wall time on purpose
	}
	require.NotEmpty(t, health.Degraded(), "health is degraded while the broker is down")
	require.Greater(t, peak, 1000.0, "backlog rose during the outage")

	require.NoError(t, kafkaSrv.Start())
	write(500)
	waitFor(t, 3*time.Minute, "the backlog to drain after the outage", func() bool { return outboxCount(t, pool) == 0 })
	waitFor(t, 30*time.Second, "the backlog gauge to fall", func() bool { return backlog() == 0 })
	waitFor(t, 30*time.Second, "health to recover", func() bool { return len(health.Degraded()) == 0 })

	msgs := consumeAll(t, brokers, topic, wantIDs(topic, keys, 0, next), 2*time.Minute)
	dups := checkOrder(t, msgs)
	t.Logf("outage: %d events, %s, backlog peak %.0f", next, fmtDup(dups, len(msgs)), peak)
	_ = ctx
}
