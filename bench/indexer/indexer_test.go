// Package bench_indexer measures the indexer end to end (Kafka topic →
// search index) against the raw engine speed for the same documents.
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

func BenchmarkIndexer(b *testing.B) {
	ctx := context.Background()
	brokers := stack.KafkaBrokers(b)
	es := stack.ElasticsearchURL(b)
	client, err := sink.NewClient(es)
	if err != nil {
		b.Fatal(err)
	}
	all := make([][]byte, docs)
	size := 0
	for i := range all {
		all[i] = document(i)
		size += len(all[i])
	}
	b.Logf("%d documents, %d bytes on average", docs, size/docs)

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
		// Raw baseline: the same documents from memory, same bulk size and
		// the same number of concurrent bulk requests.
		baseIndex := stack.UniqueName("bench-raw")
		if err := sink.CreateIndex(ctx, client, baseIndex, []byte(mapping), nil); err != nil {
			b.Fatal(err)
		}
		baseStart := time.Now()
		baseLat := rawBulk(b, client, baseIndex, all)
		baseTook := time.Since(baseStart)
		drop(client, baseIndex)

		// The indexer, from the topic.
		alias := stack.UniqueName("bench-records")
		var mu sync.Mutex
		var lat []time.Duration
		var first time.Time
		cfg := sink.Config{
			Brokers: brokers, Topic: topic, Group: stack.UniqueName("bench"), URL: es, Alias: alias,
			Mapping: []byte(mapping), BatchSize: batchSize, Lanes: lanes,
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
			BulkObserver: func(_, _ int, took time.Duration) {
				mu.Lock()
				defer mu.Unlock()
				if first.IsZero() {
					first = time.Now().Add(-took)
				}
				lat = append(lat, took)
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
		for {
			st, err := sink.GetStatus(ctx, cfg)
			if err != nil {
				b.Fatal(err)
			}
			if st.TotalLag() == 0 {
				break
			}
			select {
			case err := <-done:
				b.Fatalf("indexer stopped: %v", err)
			case <-time.After(50 * time.Millisecond):
			}
		}
		end := time.Now()
		cancel()
		if err := <-done; err != nil {
			b.Fatal(err)
		}
		drop(client, alias+"_v1")

		mu.Lock()
		steady := end.Sub(first)
		rate := float64(docs) / steady.Seconds()
		baseRate := float64(docs) / baseTook.Seconds()
		b.ReportMetric(rate, "docs/s")
		b.ReportMetric(float64(docs)/end.Sub(start).Seconds(), "docs/s_incl_group_join")
		b.ReportMetric(quantile(lat, 0.50).Seconds()*1000, "bulk_p50_ms")
		b.ReportMetric(quantile(lat, 0.99).Seconds()*1000, "bulk_p99_ms")
		b.ReportMetric(baseRate, "raw_docs/s")
		b.ReportMetric(quantile(baseLat, 0.50).Seconds()*1000, "raw_bulk_p50_ms")
		b.ReportMetric(quantile(baseLat, 0.99).Seconds()*1000, "raw_bulk_p99_ms")
		b.ReportMetric(rate/baseRate, "ratio")
		mu.Unlock()
	}
}

func rawBulk(b *testing.B, client *elastic.Client, index string, all [][]byte) []time.Duration {
	work := make(chan int)
	var mu sync.Mutex
	var lat []time.Duration
	var wg sync.WaitGroup
	for range lanes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var buf bytes.Buffer
			for lo := range work {
				buf.Reset()
				for i := lo; i < min(lo+batchSize, len(all)); i++ {
					fmt.Fprintf(&buf, `{"index":{"_index":%q,"_id":"doc-%07d","version":1,"version_type":"external"}}`+"\n", index, i)
					buf.Write(all[i])
					buf.WriteByte('\n')
				}
				t0 := time.Now()
				res, err := client.PerformRequest(context.Background(), elastic.PerformRequestOptions{
					Method: http.MethodPost, Path: "/_bulk", Body: buf.String(), ContentType: "application/x-ndjson",
					Params: url.Values{"filter_path": {"errors"}},
				})
				if err != nil || !bytes.Contains(res.Body, []byte(`"errors":false`)) {
					b.Errorf("raw bulk: %v", err)
					return
				}
				mu.Lock()
				lat = append(lat, time.Since(t0))
				mu.Unlock()
			}
		}()
	}
	for lo := 0; lo < len(all); lo += batchSize {
		work <- lo
	}
	close(work)
	wg.Wait()
	return lat
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
