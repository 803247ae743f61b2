// Package bench_publisher measures the outbox publisher against the real
// PostgreSQL and Kafka: throughput with one and three publishers, the raw
// kafka-go baseline on the publisher's produce path (Client.Produce, same
// batches, acks and compression), commit → ack latency at a steady rate, and
// 16 concurrent writers with the outbox NOTIFY trigger on and off. The
// throughput runs twice: with PostgreSQL sharing the CPUs with Kafka and the
// publishers, and with PostgreSQL on a CPU of its own (BenchmarkPublisher).
// Run with `make bench-publisher`.
package bench_publisher

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
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
	"github.com/segmentio/kafka-go/compress"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/benchround"
	"github.com/outboxrelay/outboxrelay/internal/kafkakey"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

const (
	events     = 200_000
	keys       = 10_000
	payloadPad = 430 // ~500-byte value with the JSON around it
	partitions = 6
)

// createTopic creates a topic for one run and deletes it when the run is
// over: 120 MB of log per run would otherwise stay on disk and in the page
// cache run after run, and the broker and the machine would not be in the
// same state for the first round as for the last.
func createTopic(b *testing.B, brokers []string) (topic string, drop func()) {
	topic = stack.UniqueName("bench-publisher")
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 30 * time.Second}
	resp, err := client.CreateTopics(context.Background(), &kafka.CreateTopicsRequest{
		Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: partitions, ReplicationFactor: 1}},
	})
	require.NoError(b, err)
	require.NoError(b, resp.Errors[topic])
	return topic, func() {
		resp, err := client.DeleteTopics(context.Background(), &kafka.DeleteTopicsRequest{Topics: []string{topic}})
		require.NoError(b, err)
		require.NoError(b, resp.Errors[topic])
	}
}

// fill inserts the events in one transaction; vacuum then sets their hint
// bits and visibility, as a backlog that waited a while would have them.
func fill(b *testing.B, pool *pgxpool.Pool, topic string, vacuum bool) {
	_, err := pool.Exec(context.Background(), `
INSERT INTO outbox_events (event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload)
SELECT outboxrelay_event_id('bench', g % $2 || '', g / $2 + 1, 'v1'), $1, 'bench', (g % $2)::text, g / $2 + 1, 'upsert',
       jsonb_build_object('id', g, 'pad', repeat('x', $4))
FROM generate_series(0, $3::int - 1) AS g`, topic, keys, events, payloadPad)
	require.NoError(b, err)
	if vacuum {
		_, err = pool.Exec(context.Background(), `VACUUM ANALYZE outbox_events`)
		require.NoError(b, err)
	}
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// drain runs n in-process publishers until every one of 200,000 events
// waiting in the outbox is acknowledged. Started cold, the publishers start
// once the events are in (they connect, register, wait out the join window
// and claim their shards first); running, they hold their shards already and
// the events arrive in one transaction, timed from its commit.
func drain(b *testing.B, url string, brokers []string, pool *pgxpool.Pool, n int, running bool) measured {
	topic, drop := createTopic(b, brokers)
	defer drop()
	if !running {
		fill(b, pool, topic, true)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	var clock atomic.Pointer[ackClock]
	clock.Store(newAckClock())
	var ids []string
	for range n {
		// The pool size `publisher run` uses by default, closed when this
		// run ends (the pools of earlier runs would otherwise keep their
		// connections open until the benchmark ends).
		pool, err := pgxpool.New(context.Background(), withParam(url, "pool_max_conns", strconv.Itoa(outbox.DefaultMaxConns)))
		require.NoError(b, err)
		defer pool.Close()
		pub, err := outbox.NewPublisher(pool, outbox.Config{Brokers: brokers, Logger: quiet(), LeaseTTL: 3 * time.Second,
			OnPublished: func(_ int, evs []outbox.Published) { clock.Load().acked(len(evs)) }})
		require.NoError(b, err)
		ids = append(ids, pub.ID())
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = pub.Run(ctx)
		}()
	}
	if running {
		for held := 0; held < outbox.NumShards; time.Sleep(20 * time.Millisecond) {
			require.NoError(b, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_shard_leases WHERE owner = ANY($1) AND expires_at > now()`, ids).Scan(&held))
		}
		// The clock is in place before the events commit, so no early
		// acknowledgement is lost; it is restarted at the commit.
		c := newAckClock()
		clock.Store(c)
		fill(b, pool, topic, false)
		c.restart()
	}
	c := clock.Load()
	select {
	case <-c.done:
	case <-time.After(10 * time.Minute):
		b.Fatalf("%d publisher(s): only %d of %d events acknowledged after 10 minutes", n, c.count(), events)
	}
	m := c.measured()
	cancel()
	wg.Wait()
	// Vacuum the 200,000 deleted rows now, untimed: left to autovacuum, the
	// work lands in whichever run comes next, the raw baseline included.
	// Its CPU is logged with the run's: the outbox pays it in production.
	before := stack.ReadCPU()
	_, err := pool.Exec(context.Background(), `VACUUM outbox_events`)
	require.NoError(b, err)
	m.vacuum = stack.ReadCPU().Sub(before).Postgres
	return m
}

// ackClock times a run by its acknowledgements, the same way for the
// publishers and for the raw baseline: from the start to the acknowledgement
// that completes the run. The publishers' time includes their start (they
// register, wait out the join window and claim shards); when the first
// acknowledgement came is logged as well.
type ackClock struct {
	mu          sync.Mutex
	start       time.Time
	first, last time.Time
	n           int
	cpu         stack.CPU
	used        stack.CPU
	done        chan struct{}
}

func newAckClock() *ackClock {
	return &ackClock{start: time.Now(), cpu: stack.ReadCPU(), done: make(chan struct{})}
}

// restart times the run from now, keeping what was acknowledged so far.
func (c *ackClock) restart() {
	start := time.Now()
	cpu := stack.ReadCPU()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.start, c.cpu = start, cpu
}

// withParam adds a query parameter to a connection URL.
func withParam(url, key, value string) string {
	if strings.Contains(url, "?") {
		return url + "&" + key + "=" + value
	}
	return url + "?" + key + "=" + value
}

func (c *ackClock) acked(k int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	if c.n == 0 {
		c.first = now
	}
	c.n += k
	if c.n >= events && c.last.IsZero() {
		c.last = now
		c.used = stack.ReadCPU().Sub(c.cpu)
		close(c.done)
	}
}

func (c *ackClock) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}

func (c *ackClock) measured() measured {
	c.mu.Lock()
	defer c.mu.Unlock()
	took := c.last.Sub(c.start)
	return measured{took: took, firstAck: c.first.Sub(c.start), cpu: c.used}
}

// measured is one timed run and the CPU the stack and this process used in it.
type measured struct {
	took, firstAck time.Duration
	cpu            stack.CPU
	// vacuum is the PostgreSQL CPU of vacuuming the rows the publishers
	// deleted, after the run: a cost of the run that its time leaves out.
	vacuum time.Duration
}

// rate is the run's events per second.
func (m measured) rate() float64 { return events / m.took.Seconds() }

// BenchmarkPublisher: 200,000 ~500-byte events in the outbox, drained by
// one and by three publishers, started against the waiting events (cold) or
// already running when they arrive, against the raw kafka-go baseline.
// Each of the five runs BENCH_REPEATS times (default 3), interleaved in a
// rotating order: a run that follows another finds the broker and the
// database still busy with its aftermath (log flushes, vacuum), so no
// configuration is always first or always last. Medians are reported. A
// warm-up round of raw and one publisher goes first and is not counted: on
// a freshly started broker the first runs measure its JIT compiler.
// BENCH_ONLY="1 publisher,3 publishers" runs only the configurations named
// (and raw, which the ratios need).
//
// All of it runs in two CPU layouts, one sub-benchmark each:
//   - shared-cpus: PostgreSQL, Kafka and this process share the machine's
//     CPUs. On a 2-core machine both sides saturate them, so the ratio is
//     the raw run's CPU over the publishers', and most of the difference is
//     the database's CPU per event, which the raw produce does not spend.
//   - postgres-apart: PostgreSQL has a CPU of its own and Kafka and this
//     process the others (stack.PostgresApart), as with the database on its
//     own host: the ratio is what the publisher costs the producer's side.
//
// BENCH_CPUS=shared-cpus or postgres-apart runs one of them.
func BenchmarkPublisher(b *testing.B) {
	layouts := []string{"shared-cpus", "postgres-apart"}
	if only := os.Getenv("BENCH_CPUS"); only != "" {
		require.Contains(b, layouts, only, "BENCH_CPUS names no CPU layout")
		layouts = []string{only}
	}
	for _, layout := range layouts {
		b.Run(layout, func(b *testing.B) {
			if layout == "postgres-apart" {
				stack.PostgresApart(b)
			} else {
				stack.SharedCPUs(b)
			}
			publisherRounds(b)
		})
	}
}

func publisherRounds(b *testing.B) {
	brokers := stack.KafkaBrokers(b)
	url := stack.Database(b)
	pool := stack.Pool(b, url)
	rounds := benchround.Repeats(b)
	type config struct {
		name string
		run  func() measured
	}
	configs := []config{
		{"raw kafka-go", func() measured { return baseline(b, brokers) }},
		{"1 publisher", func() measured { return drain(b, url, brokers, pool, 1, false) }},
		{"3 publishers", func() measured { return drain(b, url, brokers, pool, 3, false) }},
		{"1 publisher running", func() measured { return drain(b, url, brokers, pool, 1, true) }},
		{"3 publishers running", func() measured { return drain(b, url, brokers, pool, 3, true) }},
	}
	if only := os.Getenv("BENCH_ONLY"); only != "" {
		names := strings.Split(only, ",")
		configs = slices.DeleteFunc(configs, func(c config) bool {
			return c.name != "raw kafka-go" && !slices.Contains(names, c.name)
		})
		require.Greater(b, len(configs), 1, "BENCH_ONLY=%q names no configuration", only)
	}
	for _, c := range configs[:2] {
		m := c.run()
		b.Logf("warm-up, %s: %.0f events/s (not counted)", c.name, m.rate())
	}
	rates := map[string]benchround.Series{}
	var allocs benchround.Series
	// byRound[r][name] is a configuration's rate in round r: each is
	// compared with the raw baseline of its own round, as bench-indexer and
	// bench-batcher compare theirs.
	byRound := make([]map[string]float64, rounds)
	for r := range rounds {
		byRound[r] = map[string]float64{}
		for i := range configs {
			c := configs[(i+r)%len(configs)]
			var ms runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&ms)
			before := ms.TotalAlloc
			m := c.run()
			runtime.ReadMemStats(&ms)
			rates[c.name] = append(rates[c.name], m.rate())
			byRound[r][c.name] = m.rate()
			if c.name == "1 publisher" {
				allocs = append(allocs, float64(ms.TotalAlloc-before)/events)
			}
			vacuum := ""
			if !strings.HasPrefix(c.name, "raw") {
				vacuum = fmt.Sprintf("; then VACUUM of the deleted rows, not timed: postgres %.2fs", m.vacuum.Seconds())
			}
			b.Logf("round %d, %s: %d events in %s = %.0f events/s (first ack after %s); %s%s",
				r+1, c.name, events, m.took.Round(time.Millisecond), m.rate(), m.firstAck.Round(time.Millisecond), m.cpu, vacuum)
		}
	}
	raw := rates["raw kafka-go"].Median()
	b.ReportMetric(raw, "events/s-raw")
	if len(allocs) > 0 {
		b.ReportMetric(allocs.Median(), "B/event")
	}
	// The ratio reported is the median of the rounds' ratios, each rate
	// over its own round's raw baseline, so that the machine's drift
	// between rounds cancels out. The ratio of the medians is logged beside
	// it.
	summary := fmt.Sprintf("medians of %d rounds: raw kafka-go %.0f events/s (%s)", rounds, raw, rates["raw kafka-go"].Spread("%.0f"))
	for _, c := range configs[1:] {
		rate := rates[c.name].Median()
		var ratios benchround.Series
		for _, round := range byRound {
			ratios = append(ratios, round[c.name]/round["raw kafka-go"])
		}
		unit := strings.ReplaceAll(strings.ReplaceAll(c.name, " publishers", "pub"), " publisher", "pub")
		unit = strings.ReplaceAll(unit, " ", "-")
		b.ReportMetric(rate, "events/s-"+unit)
		b.ReportMetric(ratios.Median(), "ratio-"+unit)
		summary += fmt.Sprintf("; %s %.0f events/s, ratio %.2f (rounds %s; ratio of the medians %.2f)",
			c.name, rate, ratios.Median(), ratios.Spread("%.2f"), rate/raw)
	}
	b.Log(summary)
}

// baseline produces the same records from memory the way the publisher's
// producer does (outbox/producer.go): 64 shard goroutines, calls of up to
// 2000 events / 1 MB, each call one kafka.Client.Produce request per
// partition (murmur2 of the key, acks=all, the publisher's default
// compression: rawCodec), sent in
// parallel, on one client with the publisher's transport settings. So the
// ratio compares the publisher's database work and bookkeeping with the
// same Kafka path, not with kafka.Writer's.
// rawCodec is outbox.DefaultCompression, the codec the publishers under
// test send with.
var rawCodec = func() compress.Compression {
	var c compress.Compression
	if err := c.UnmarshalText([]byte(outbox.DefaultCompression)); err != nil {
		panic(err)
	}
	return c
}()

func baseline(b *testing.B, brokers []string) measured {
	topic, drop := createTopic(b, brokers)
	defer drop()
	transport := &kafka.Transport{DialTimeout: 5 * time.Second, IdleTimeout: 30 * time.Second, MetadataTTL: 10 * time.Second, ClientID: "outboxrelay-bench-raw"}
	defer transport.CloseIdleConnections()
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Transport: transport}
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
	meta, err := client.Metadata(context.Background(), &kafka.MetadataRequest{Topics: []string{topic}})
	require.NoError(b, err)
	require.Len(b, meta.Topics, 1)
	require.NoError(b, meta.Topics[0].Error)
	ids := make([]int, len(meta.Topics[0].Partitions))
	for i := range ids {
		ids[i] = i
	}
	// The records just built are 450 MB of heap. Collect now, so that the
	// run does not pay for marking them: that is this benchmark's own
	// bookkeeping, not producing.
	runtime.GC()
	clock := newAckClock()
	var wg sync.WaitGroup
	for _, msgs := range shards {
		wg.Add(1)
		go func() {
			defer wg.Done()
			balancer := kafkakey.Balancer()
			for len(msgs) > 0 {
				// The publisher's rule: a call stops before BatchBytes.
				n, bytes := 0, 0
				for n < len(msgs) && n < outbox.DefaultBatchSize && bytes+size(&msgs[n]) <= outbox.DefaultBatchBytes {
					bytes += size(&msgs[n])
					n++
				}
				require.NoError(b, produce(client, balancer, ids, msgs[:n]))
				clock.acked(n)
				msgs = msgs[n:]
			}
		}()
	}
	wg.Wait()
	return clock.measured()
}

// produce sends one call as the publisher's producer does: one Produce
// request per partition, in parallel, acks=all.
func produce(client *kafka.Client, balancer kafka.Balancer, ids []int, msgs []kafka.Message) error {
	byPartition := map[int][]kafka.Record{}
	for i := range msgs {
		m := &msgs[i]
		p := balancer.Balance(*m, ids...)
		byPartition[p] = append(byPartition[p], kafka.Record{Time: m.Time, Headers: m.Headers, Key: kafka.NewBytes(m.Key), Value: kafka.NewBytes(m.Value)})
	}
	errs := make(chan error, len(byPartition))
	for p, records := range byPartition {
		go func() {
			res, err := client.Produce(context.Background(), &kafka.ProduceRequest{
				Topic: msgs[0].Topic, Partition: p, RequiredAcks: kafka.RequireAll, Compression: rawCodec, Records: kafka.NewRecordReader(records...),
			})
			if err == nil && res.Error != nil {
				err = res.Error
			}
			errs <- err
		}()
	}
	var first error
	for range byPartition {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	return first
}

// size is kafka-go's estimate of a record's size, the one the publisher
// keeps each call under BatchBytes with.
func size(m *kafka.Message) int {
	n := 1
	for _, h := range m.Headers {
		n += 2 + len(h.Key) + len(h.Value)
	}
	return n + 4 + 1 + 1 + 4 + len(m.Key) + 4 + len(m.Value) + 8
}

// BenchmarkPublisherLatency: commit → broker ack at a steady 1,000 events/s
// (one event per transaction), one publisher.
func BenchmarkPublisherLatency(b *testing.B) {
	brokers := stack.KafkaBrokers(b)
	url := stack.Database(b)
	pool := stack.Pool(b, url)
	topic, drop := createTopic(b, brokers)
	defer drop()
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

// BenchmarkPublisherWriters: 16 application writers commit one event per
// transaction while one publisher runs, with the outbox's NOTIFY trigger on
// (the default) and off (`publisher notify off`; the publisher then polls
// every 100ms). NOTIFY takes PostgreSQL's global notify lock from each
// commit until it is done, so concurrent writers of the outbox commit one
// after another; the writers' rate shows what that costs them, the
// end-to-end rate (last acknowledgement) what the publisher delivers.
// Interleaved over BENCH_REPEATS rounds; medians reported.
func BenchmarkPublisherWriters(b *testing.B) {
	brokers := stack.KafkaBrokers(b)
	url := stack.Database(b)
	pool := stack.Pool(b, url)
	rounds := benchround.Repeats(b)
	const writers, perWriter = 16, 1500
	writersPool := stack.Pool(b, withParam(url, "pool_max_conns", strconv.Itoa(writers)))
	payload := []byte(`{"pad":"` + strings.Repeat("x", payloadPad) + `"}`)
	run := func(notify bool) (writeRate, deliverRate float64) {
		require.NoError(b, outbox.SetNotify(context.Background(), pool, notify))
		defer func() { require.NoError(b, outbox.SetNotify(context.Background(), pool, true)) }()
		topic, drop := createTopic(b, brokers)
		defer drop()
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		const total = writers * perWriter
		var acked atomic.Int64
		allAcked := make(chan time.Time, 1)
		pubPool, err := pgxpool.New(context.Background(), withParam(url, "pool_max_conns", "1"))
		require.NoError(b, err)
		defer pubPool.Close()
		pub, err := outbox.NewPublisher(pubPool, outbox.Config{Brokers: brokers, Logger: quiet(), LeaseTTL: 3 * time.Second,
			ShardConns: outbox.DefaultMaxConns, PollInterval: 100 * time.Millisecond,
			OnPublished: func(_ int, evs []outbox.Published) {
				if acked.Add(int64(len(evs))) == total {
					allAcked <- time.Now()
				}
			}})
		require.NoError(b, err)
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = pub.Run(ctx)
		}()
		for held := 0; held < outbox.NumShards; time.Sleep(20 * time.Millisecond) {
			require.NoError(b, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_shard_leases WHERE owner = $1 AND expires_at > now()`, pub.ID()).Scan(&held))
		}
		start := time.Now()
		var wg sync.WaitGroup
		for w := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range perWriter {
					key := strconv.Itoa(w*perWriter + i)
					_, err := outbox.Enqueue(ctx, writersPool, outbox.Event{ID: outbox.EventID("writers", key, 1, topic), Topic: topic,
						AggregateID: key, AggregateVersion: 1, Payload: payload})
					if err != nil {
						b.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		wrote := time.Since(start)
		var last time.Time
		select {
		case last = <-allAcked:
		case <-time.After(5 * time.Minute):
			b.Fatalf("only %d of %d events acknowledged", acked.Load(), total)
		}
		cancel()
		<-done
		_, err = pool.Exec(context.Background(), `VACUUM outbox_events`)
		require.NoError(b, err)
		return total / wrote.Seconds(), total / last.Sub(start).Seconds()
	}
	run(true) // warm-up, not counted
	writes := map[bool]benchround.Series{}
	delivers := map[bool]benchround.Series{}
	for r := range rounds {
		for _, notify := range []bool{r%2 == 0, r%2 != 0} {
			w, d := run(notify)
			writes[notify] = append(writes[notify], w)
			delivers[notify] = append(delivers[notify], d)
			b.Logf("round %d, %d writers, NOTIFY %s: writers commit %.0f events/s, delivered %.0f events/s", r+1, writers, onOff(notify), w, d)
		}
	}
	for _, notify := range []bool{true, false} {
		b.ReportMetric(writes[notify].Median(), "events/s-write-notify-"+onOff(notify))
		b.ReportMetric(delivers[notify].Median(), "events/s-delivered-notify-"+onOff(notify))
	}
	b.Logf("medians of %d rounds, %d writers, one event per transaction: NOTIFY on: writers %.0f events/s, delivered %.0f events/s; NOTIFY off (polling 100ms): writers %.0f events/s, delivered %.0f events/s",
		rounds, writers, writes[true].Median(), delivers[true].Median(), writes[false].Median(), delivers[false].Median())
}

func onOff(on bool) string {
	if on {
		return "on"
	}
	return "off"
}
