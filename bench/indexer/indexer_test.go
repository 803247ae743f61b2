// Package bench_indexer measures the indexer end to end (Kafka topic →
// search index) against the raw engine speed for the same documents: the
// raw side bulk-indexes the same 200,000 documents from memory into an
// index with the same settings, with the same bulk size, the same number
// of concurrent bulk requests and the same external versions. The two run
// interleaved for BENCH_REPEATS rounds (default 3), each indexer round with
// a new consumer group from the start of the topic, and the medians are
// reported; the ratio is the median of the per-round ratios (each against
// the raw run of its own round), because the machine is shared and noisy.
// The indexer is done when every offset is committed.
//
//	make bench-indexer
package bench_indexer

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/segmentio/kafka-go"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/benchround"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
	"github.com/outboxrelay/outboxrelay/sink"
)

func TestMain(m *testing.M) { stack.Main(m) }

const (
	docs       = 200_000
	partitions = 4
	batchSize  = 1000
	lanes      = sink.DefaultLanes
	mapping    = `{"settings":{"number_of_shards":1,"number_of_replicas":0},"mappings":{"properties":{"_deleted":{"type":"boolean"}}}}`
)

// document returns a ~500-byte JSON document.
func document(i int) []byte {
	return fmt.Appendf(nil, `{"id":"doc-%07d","tenant":"tenant-%03d","title":"Benchmark document number %d","status":"active","amount":%d,"tags":["alpha","beta","gamma"],"created_at":"2026-01-01T00:00:00Z","body":"%s"}`,
		i, i%100, i, i*7%100000, bytes.Repeat([]byte("lorem ipsum "), 29))
}

// run is one side of one round.
type run struct {
	rate     float64 // docs/s from the first bulk to the end
	joinRate float64 // docs/s including the consumer group join (indexer only)
	lat      []time.Duration
}

func BenchmarkIndexer(b *testing.B) {
	ctx := context.Background()
	brokers := stack.KafkaBrokers(b)
	es := stack.ElasticsearchURL(b)
	client, err := index.NewClient(es)
	if err != nil {
		b.Fatal(err)
	}
	all := make([][]byte, docs)
	size := 0
	for i := range all {
		all[i] = document(i)
		size += len(all[i])
	}
	repeats := benchround.Repeats(b)
	b.Logf("%d documents, %d bytes on average, %d rounds", docs, size/docs, repeats)

	// The topic.
	topic := stack.UniqueName("bench-indexer")
	kc := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 30 * time.Second}
	if _, err := kc.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: partitions, ReplicationFactor: 1}}}); err != nil {
		b.Fatal(err)
	}
	w := &kafka.Writer{Addr: kafka.TCP(brokers...), Topic: topic, Balancer: &kafka.Hash{}, RequiredAcks: kafka.RequireAll, BatchSize: 5000, BatchBytes: 8 << 20, BatchTimeout: 10 * time.Millisecond, Compression: kafka.Lz4}
	msgs := make([]kafka.Message, 0, 10000)
	for i, d := range all {
		msgs = append(msgs, kafka.Message{Key: fmt.Appendf(nil, "doc-%07d", i), Value: d, Headers: []kafka.Header{
			{Key: outbox.HeaderType, Value: []byte(outbox.TypePrefix + "upsert")},
			{Key: outbox.HeaderAggregateVersion, Value: []byte("1")},
			{Key: outbox.HeaderID, Value: fmt.Appendf(nil, "ev-%d", i)},
		}})
		if len(msgs) == cap(msgs) || i == len(all)-1 {
			if err := w.WriteMessages(ctx, msgs...); err != nil {
				b.Fatal(err)
			}
			msgs = msgs[:0]
		}
	}
	_ = w.Close()

	b.ReportAllocs()
	for b.Loop() {
		var rate, joinRate, baseRate, ratio benchround.Series
		var lat, baseLat []time.Duration
		for round := range repeats {
			base := rawBulk(b, client, all)
			ix := runIndexer(b, brokers, topic, es)
			rate, joinRate, baseRate = append(rate, ix.rate), append(joinRate, ix.joinRate), append(baseRate, base.rate)
			ratio = append(ratio, ix.rate/base.rate)
			lat, baseLat = append(lat, ix.lat...), append(baseLat, base.lat...)
			b.Logf("round %d: raw %.0f docs/s, indexer %.0f docs/s (%.0f with the group join), ratio %.2f", round, base.rate, ix.rate, ix.joinRate, ix.rate/base.rate)
		}
		b.ReportMetric(rate.Median(), "docs/s")
		b.ReportMetric(joinRate.Median(), "docs/s_incl_group_join")
		b.ReportMetric(quantile(lat, 0.50).Seconds()*1000, "bulk_p50_ms")
		b.ReportMetric(quantile(lat, 0.99).Seconds()*1000, "bulk_p99_ms")
		b.ReportMetric(baseRate.Median(), "raw_docs/s")
		b.ReportMetric(quantile(baseLat, 0.50).Seconds()*1000, "raw_bulk_p50_ms")
		b.ReportMetric(quantile(baseLat, 0.99).Seconds()*1000, "raw_bulk_p99_ms")
		b.ReportMetric(ratio.Median(), "ratio")
		b.Logf("median over %d rounds: raw %.0f docs/s, indexer %.0f docs/s, ratio %.2f (%s)", repeats, baseRate.Median(), rate.Median(), ratio.Median(), ratio.Spread("%.2f"))
	}
}

// runIndexer indexes the whole topic with a new group into a new index and
// returns when every offset is committed.
func runIndexer(b *testing.B, brokers []string, topic, es string) run {
	ctx := context.Background()
	alias := stack.UniqueName("bench-records")
	var mu sync.Mutex
	var lat []time.Duration
	var first time.Time
	sent := 0
	allSent := make(chan struct{})
	cfg := sink.Config{
		Brokers: brokers, Topic: topic, Group: stack.UniqueName("bench"), URL: es, Alias: alias,
		Mapping: []byte(mapping), BatchSize: batchSize, Lanes: lanes,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		BulkObserver: func(n, _ int, took time.Duration) {
			mu.Lock()
			defer mu.Unlock()
			if first.IsZero() {
				first = time.Now().Add(-took)
			}
			lat = append(lat, took)
			if sent < docs && sent+n >= docs {
				close(allSent)
			}
			sent += n
		},
	}
	ix, err := sink.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- ix.Run(rctx) }()
	// Polling the group's offsets all along would load the broker and the
	// engine (the status also reads the aliases) during the measurement,
	// which the raw side does not pay: wait until every document has been
	// in a bulk, then poll the offsets only until the last commits land.
	select {
	case <-allSent:
	case err := <-done:
		b.Fatalf("indexer stopped: %v", err)
	}
	lagCfg := cfg
	lagCfg.URL = "" // offsets only
	for {
		st, err := sink.GetStatus(ctx, lagCfg)
		if err != nil {
			b.Fatal(err)
		}
		if st.TotalLag() == 0 {
			break
		}
		select {
		case err := <-done:
			b.Fatalf("indexer stopped: %v", err)
		case <-time.After(5 * time.Millisecond):
		}
	}
	end := time.Now()
	cancel()
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	drop(ix.Client(), alias+"_v1")
	mu.Lock()
	defer mu.Unlock()
	return run{
		rate:     float64(docs) / end.Sub(first).Seconds(),
		joinRate: float64(docs) / end.Sub(start).Seconds(),
		lat:      lat,
	}
}

// rawBulk indexes the documents from memory into a new index with the
// indexer's bulk size and number of concurrent bulk requests.
func rawBulk(b *testing.B, client *elastic.Client, all [][]byte) run {
	ctx := context.Background()
	idx := stack.UniqueName("bench-raw")
	if err := index.Create(ctx, client, idx, []byte(mapping), nil); err != nil {
		b.Fatal(err)
	}
	defer drop(client, idx)
	start := time.Now()
	work := make(chan int)
	var mu sync.Mutex
	var lat []time.Duration
	var wg sync.WaitGroup
	for range lanes {
		wg.Go(func() {
			var buf bytes.Buffer
			for lo := range work {
				buf.Reset()
				for i := lo; i < min(lo+batchSize, len(all)); i++ {
					fmt.Fprintf(&buf, `{"index":{"_index":%q,"_id":"doc-%07d","version":1,"version_type":"external"}}`+"\n", idx, i)
					buf.Write(all[i])
					buf.WriteByte('\n')
				}
				t0 := time.Now()
				res, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
					Method: http.MethodPost, Path: "/_bulk", Body: buf.String(), ContentType: "application/x-ndjson",
					Params: url.Values{"filter_path": {"errors"}},
				})
				if err != nil || !bytes.Contains(res.Body, []byte(`"errors":false`)) {
					b.Errorf("raw bulk: %v", err)
					continue // the sender must not block
				}
				mu.Lock()
				lat = append(lat, time.Since(t0))
				mu.Unlock()
			}
		})
	}
	for lo := 0; lo < len(all); lo += batchSize {
		work <- lo
	}
	close(work)
	wg.Wait()
	return run{rate: float64(docs) / time.Since(start).Seconds(), lat: lat}
}

func quantile(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(q*float64(len(s))))]
}

func drop(client *elastic.Client, index string) {
	_, _ = client.PerformRequest(context.Background(), elastic.PerformRequestOptions{Method: http.MethodDelete, Path: "/" + index, IgnoreErrors: []int{404}})
}
