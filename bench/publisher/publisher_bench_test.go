// Package bench_publisher measures the outbox publisher against the real
// PostgreSQL and Kafka: throughput with one and three publishers, the raw
// kafka-go baseline with the same writer settings, and commit → ack latency
// at a steady rate. Run with `make bench-publisher`.
package bench_publisher

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

const (
	events     = 200_000
	keys       = 10_000
	payloadPad = 430 // ~500-byte value with the JSON around it
	partitions = 6
)

func createTopic(b *testing.B, brokers []string) string {
	topic := stack.UniqueName("bench-publisher")
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 30 * time.Second}
	resp, err := client.CreateTopics(context.Background(), &kafka.CreateTopicsRequest{
		Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: partitions, ReplicationFactor: 1}},
	})
	require.NoError(b, err)
	require.NoError(b, resp.Errors[topic])
	return topic
}

func fill(b *testing.B, pool *pgxpool.Pool, topic string) {
	_, err := pool.Exec(context.Background(), `
INSERT INTO outbox_events (event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload)
SELECT outboxrelay_event_id('bench', g % $2 || '', g / $2 + 1, 'v1'), $1, 'bench', (g % $2)::text, g / $2 + 1, 'upsert',
       jsonb_build_object('id', g, 'pad', repeat('x', $4))
FROM generate_series(0, $3::int - 1) AS g`, topic, keys, events, payloadPad)
	require.NoError(b, err)
	_, err = pool.Exec(context.Background(), `VACUUM ANALYZE outbox_events`)
	require.NoError(b, err)
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// drain runs n in-process publishers until the outbox is empty.
func drain(b *testing.B, url string, brokers []string, n int) time.Duration {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var published atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range n {
		pool := stack.Pool(b, url)
		pub, err := outbox.NewPublisher(pool, outbox.Config{Brokers: brokers, Logger: quiet(), LeaseTTL: 3 * time.Second,
			OnPublished: func(_ int, evs []outbox.Published) { published.Add(int64(len(evs))) }})
		require.NoError(b, err)
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = pub.Run(ctx)
		}()
	}
	deadline := time.Now().Add(10 * time.Minute)
	for published.Load() < events && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond) // polling a counter for the stop time
	}
	took := time.Since(start)
	cancel()
	wg.Wait()
	require.GreaterOrEqual(b, published.Load(), int64(events))
	return took
}

// BenchmarkPublisher: 200,000 ~500-byte events already in the outbox.
func BenchmarkPublisher(b *testing.B) {
	brokers := stack.KafkaBrokers(b)
	url := stack.Database(b)
	pool := stack.Pool(b, url)
	var one, three time.Duration
	for _, n := range []int{1, 3} {
		topic := createTopic(b, brokers)
		fill(b, pool, topic)
		var ms runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&ms)
		before := ms.TotalAlloc
		took := drain(b, url, brokers, n)
		runtime.ReadMemStats(&ms)
		b.Logf("%d publisher(s): %d events in %s = %.0f events/s, %.0f bytes allocated/event", n, events, took,
			events/took.Seconds(), float64(ms.TotalAlloc-before)/events)
		if n == 1 {
			one = took
			b.ReportMetric(float64(ms.TotalAlloc-before)/events, "B/event")
		} else {
			three = took
		}
	}
	raw := baseline(b, brokers)
	b.ReportMetric(events/one.Seconds(), "events/s-1pub")
	b.ReportMetric(events/three.Seconds(), "events/s-3pub")
	b.ReportMetric(events/raw.Seconds(), "events/s-raw")
	b.ReportMetric(raw.Seconds()/one.Seconds(), "ratio-1pub")
	b.ReportMetric(raw.Seconds()/three.Seconds(), "ratio-3pub")
	b.Logf("raw kafka-go baseline: %.0f events/s; ratio 1 publisher %.2f, 3 publishers %.2f",
		events/raw.Seconds(), raw.Seconds()/one.Seconds(), raw.Seconds()/three.Seconds())
}

// baseline produces the same records from memory with the publisher's writer
// settings and shape: 64 shard writers, batches of up to 2000 events / 1 MB.
func baseline(b *testing.B, brokers []string) time.Duration {
	topic := createTopic(b, brokers)
	transport := &kafka.Transport{}
	defer transport.CloseIdleConnections()
	pad := make([]byte, payloadPad)
	for i := range pad {
		pad[i] = 'x'
	}
	shards := make([][]kafka.Message, outbox.NumShards)
	for g := range events {
		key := strconv.Itoa(g % keys)
		value := fmt.Appendf(nil, `{"id": %d, "pad": "%s"}`, g, pad)
		hs := []kafka.Header{
			{Key: outbox.HeaderSpecVersion, Value: []byte(outbox.SpecVersion)},
			{Key: outbox.HeaderID, Value: []byte(outbox.EventID("bench", key, int64(g/keys+1), "v1"))},
			{Key: outbox.HeaderSource, Value: []byte("outboxrelay")},
			{Key: outbox.HeaderType, Value: []byte("outboxrelay.upsert")},
			{Key: outbox.HeaderSubject, Value: []byte(key)},
			{Key: outbox.HeaderTime, Value: []byte(time.Now().UTC().Format(time.RFC3339Nano))},
			{Key: outbox.HeaderAggregateVersion, Value: []byte(strconv.Itoa(g/keys + 1))},
			{Key: outbox.HeaderAggregateType, Value: []byte("bench")},
			{Key: outbox.HeaderContentType, Value: []byte("application/json")},
		}
		s := (g % keys) % outbox.NumShards
		shards[s] = append(shards[s], kafka.Message{Topic: topic, Key: []byte(key), Value: value, Headers: hs})
	}
	start := time.Now()
	var wg sync.WaitGroup
	for _, msgs := range shards {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w := &kafka.Writer{Addr: kafka.TCP(brokers...), Balancer: &kafka.Murmur2Balancer{}, RequiredAcks: kafka.RequireAll,
				BatchSize: outbox.DefaultBatchSize, BatchBytes: outbox.DefaultBatchBytes, BatchTimeout: outbox.DefaultBatchTimeout,
				MaxAttempts: 1, Transport: transport}
			defer w.Close()
			for len(msgs) > 0 {
				n, bytes := 0, 0
				for n < len(msgs) && n < outbox.DefaultBatchSize && bytes+len(msgs[n].Value)+400 < outbox.DefaultBatchBytes {
					bytes += len(msgs[n].Value) + 400
					n++
				}
				require.NoError(b, w.WriteMessages(context.Background(), msgs[:n]...))
				msgs = msgs[n:]
			}
		}()
	}
	wg.Wait()
	return time.Since(start)
}

// BenchmarkPublisherLatency: commit → broker ack at a steady 1,000 events/s
// (one event per transaction), one publisher.
func BenchmarkPublisherLatency(b *testing.B) {
	brokers := stack.KafkaBrokers(b)
	url := stack.Database(b)
	pool := stack.Pool(b, url)
	topic := createTopic(b, brokers)
	const rate, total = 1000, 10_000
	// An ack can be seen before Enqueue returns to the writer goroutine:
	// whichever of commit and ack is recorded second makes the sample, so no
	// sample is lost to that race.
	var mu sync.Mutex
	committed := map[string]time.Time{}
	acked := map[string]outbox.Published{}
	var lat []time.Duration
	done := make(chan struct{})
	sample := func(c time.Time, e outbox.Published) {
		lat = append(lat, e.AckedAt.Sub(c))
		if len(lat) == total {
			close(done)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pub, err := outbox.NewPublisher(stack.Pool(b, url+"&pool_max_conns=16"), outbox.Config{Brokers: brokers, Logger: quiet(),
		OnPublished: func(_ int, evs []outbox.Published) {
			mu.Lock()
			defer mu.Unlock()
			for _, e := range evs {
				if c, ok := committed[e.EventID]; ok {
					delete(committed, e.EventID)
					sample(c, e)
				} else {
					acked[e.EventID] = e
				}
			}
		}})
	require.NoError(b, err)
	go func() { _ = pub.Run(ctx) }()
	// Time only once the publisher holds every shard.
	for held := 0; held < outbox.NumShards; time.Sleep(20 * time.Millisecond) {
		require.NoError(b, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_shard_leases WHERE owner = $1`, pub.ID()).Scan(&held))
	}
	payload := []byte(`{"pad":"` + strings.Repeat("x", payloadPad) + `"}`)

	// Several writers, each paced, so a slow commit does not slow the rate.
	const writers = 8
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tick := time.NewTicker(time.Second * writers / rate)
			defer tick.Stop()
			for i := w; i < total; i += writers {
				<-tick.C
				id := outbox.EventID("lat", strconv.Itoa(i), 1, "v1")
				var commit time.Time
				_, err := outbox.Enqueue(ctx, pool, outbox.Event{ID: id, Topic: topic, AggregateID: strconv.Itoa(i), AggregateVersion: 1,
					Payload: payload})
				commit = time.Now()
				if err != nil {
					b.Error(err)
					return
				}
				mu.Lock()
				if e, ok := acked[id]; ok {
					delete(acked, id)
					sample(commit, e)
				} else {
					committed[id] = commit
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	select {
	case <-done:
	case <-time.After(time.Minute):
	}
	mu.Lock()
	defer mu.Unlock()
	require.NotEmpty(b, lat)
	slices.Sort(lat)
	p50, p99 := lat[len(lat)/2], lat[len(lat)*99/100]
	b.ReportMetric(float64(p50.Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(p99.Microseconds())/1000, "p99-ms")
	b.Logf("commit → ack at %d events/s: %d samples, p50 %s, p99 %s, max %s", rate, len(lat), p50, p99, lat[len(lat)-1])
}
