package sink

import (
	"context"
	"fmt"
	"maps"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// A replayed dead letter lands on the partition the publisher puts its key
// on (kafka-go's Murmur2Balancer, as the Java client), so the key's events
// stay on one partition, in order.
func TestDeadLetterReplayKeepsPublisherPartition(t *testing.T) {
	t.Parallel()
	const partitions = 8
	real := stack.ElasticsearchURL(t)
	f := newFixture(t, real, real, partitions)
	ctx := context.Background()
	dlq := f.cfg.withDefaults().DeadLetterTopic
	require.NoError(t, ensureTopic(ctx, f.cfg.Brokers, dlq, 1))

	var msgs []kafka.Message
	for i := range 40 {
		m := upsert(fmt.Sprintf("key-%d", i), 1, docN(i)).message()
		m.Headers = append(m.Headers, kafka.Header{Key: HeaderDLQTopic, Value: []byte(f.cfg.Topic)})
		msgs = append(msgs, m)
	}
	w := &kafka.Writer{Addr: kafka.TCP(f.cfg.Brokers...), Topic: dlq, RequiredAcks: kafka.RequireAll, BatchTimeout: 2 * time.Millisecond}
	defer w.Close()
	require.NoError(t, w.WriteMessages(ctx, msgs...))

	res, err := ReplayDeadLetters(ctx, f.cfg)
	require.NoError(t, err)
	require.Equal(t, len(msgs), res.Republished)

	ids := make([]int, partitions)
	for i := range ids {
		ids[i] = i
	}
	publisher := &kafka.Murmur2Balancer{} // what outbox's writers use
	got := 0
	for p := range partitions {
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: f.cfg.Brokers, Topic: f.cfg.Topic, Partition: p, MaxWait: 100 * time.Millisecond})
		end := f.offsets("none")[p].End
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		for off := int64(0); off < end; off++ {
			m, err := r.FetchMessage(rctx)
			require.NoError(t, err)
			require.Equal(t, publisher.Balance(kafka.Message{Key: m.Key}, ids...), p, "key %s", m.Key)
			got++
		}
		cancel()
		r.Close()
	}
	require.Equal(t, len(msgs), got)
}

// A document the engine refuses can be as large as the main topic allows;
// it still goes to the dead-letter topic (kafka-go's writer refuses a
// message over its BatchBytes, 1 MiB by default, before sending it). The
// dead-letter topic keeps its messages forever by default: the main
// offsets are committed once they are written, so an expiring dead letter
// is lost unseen. Its size is a metric an alert can use.
func TestDeadLetterLargeDocumentKeptForever(t *testing.T) {
	t.Parallel()
	real := stack.ElasticsearchURL(t)
	f := newFixture(t, real, real, 1)
	ctx := context.Background()
	const topicMax = 4 << 20
	big := fixtureTopic(t, f, topicMax)

	doc := `{"extra":{"color":"` + strings.Repeat("r", 2<<20) + `"}}` // strict mapping: refused by the engine
	w := &kafka.Writer{Addr: kafka.TCP(f.cfg.Brokers...), Topic: big, RequiredAcks: kafka.RequireAll, BatchBytes: topicMax}
	defer w.Close()
	require.NoError(t, w.WriteMessages(ctx, upsert("big", 1, doc).message(), upsert("small", 1, docN(1)).message(), upsert("bad", 1, `{"extra":{"x":1}}`).message()))

	cfg := f.cfg
	cfg.Topic = big
	cfg.Registerer = prometheus.NewRegistry()
	ix := f.start(cfg)
	f.cfg.Topic = big
	f.waitCaughtUp(cfg.Group, time.Minute)
	dl := f.deadLetters(2)
	require.Equal(t, "big", string(dl[0].Key))
	require.Equal(t, doc, string(dl[0].Value))
	require.Equal(t, "strict_dynamic_mapping_exception", headerMap(dl[0])[HeaderDLQCode])
	require.Equal(t, "v1 "+docN(1), f.search(f.cfg.Alias)["small"])

	conf, err := topicConfig(ctx, f.kclient, cfg.withDefaults().DeadLetterTopic, "retention.ms")
	require.NoError(t, err)
	require.Equal(t, "-1", conf["retention.ms"])

	eventually(t, 30*time.Second, func() error {
		stored := gaugeValue(t, ix.m.deadLetterTopic.WithLabelValues("stored"))
		pending := gaugeValue(t, ix.m.deadLetterTopic.WithLabelValues("pending"))
		if stored != 2 || pending != 2 {
			return fmt.Errorf("indexer_dead_letter_topic_messages stored %g, pending %g; want 2, 2", stored, pending)
		}
		return nil
	})
}

// fixtureTopic creates another topic for f that takes messages up to
// maxBytes.
func fixtureTopic(t *testing.T, f *fixture, maxBytes int) string {
	t.Helper()
	topic := stack.UniqueName("sink-big")
	ctx := context.Background()
	require.NoError(t, ensureTopic(ctx, f.cfg.Brokers, topic, 1, kafka.ConfigEntry{ConfigName: "max.message.bytes", ConfigValue: strconv.Itoa(maxBytes)}))
	eventually(t, 30*time.Second, func() error {
		_, err := topicOffsets(ctx, f.kclient, topic, "none")
		return err
	})
	return topic
}

// The dead-letter writer gives up when the run ends, whatever the broker
// does: here it accepts connections and never answers. The write is still
// waiting on it when the run ends, and returns the run's end (context
// canceled) at once, not an error of its own.
func TestDeadLetterWriteDoesNotHangShutdown(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	connected := make(chan struct{}) // closed on the writer's first connection
	accepted := make(chan []net.Conn, 1)
	go func() {
		var conns []net.Conn // held open, never answered
		for {
			c, err := ln.Accept()
			if err != nil {
				accepted <- conns
				return
			}
			if len(conns) == 0 {
				close(connected)
			}
			conns = append(conns, c)
		}
	}()
	defer func() {
		ln.Close()
		for _, c := range <-accepted {
			c.Close()
		}
	}()
	cfg := Config{Brokers: []string{ln.Addr().String()}, URL: "http://127.0.0.1:1"}.withDefaults()
	w := newDeadLetterWriter(cfg)
	defer w.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d := parse(upsert("a", 1, docN(1)).message(), DefaultMaxDocumentBytes)
	d.poison = &itemError{Code: "test", Reason: "test"}
	done := make(chan error, 1)
	go func() { done <- w.write(ctx, cfg, []*doc{d}) }()
	select {
	case <-connected: // the write waits on the silent broker
	case err := <-done:
		t.Fatalf("dead-letter write returned before the run ended: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("the dead-letter writer never connected to the broker")
	}
	cancel() // SIGTERM
	stopped := time.Now()
	select {
	case err := <-done:
		require.Less(t, time.Since(stopped), 2*time.Second, "returned %s after the context ended", time.Since(stopped))
		// Only the run's end, not a broker error, a timeout or a
		// misclassified "too large" (whose message names
		// DEAD_LETTER_MAX_BYTES).
		require.ErrorIs(t, err, context.Canceled)
		require.EqualError(t, err, fmt.Sprintf("write 1 message(s) to dead-letter topic %s: %v", cfg.DeadLetterTopic, context.Canceled))
	case <-time.After(20 * time.Second):
		t.Fatal("dead-letter write still blocked 20s after the context ended")
	}
}

// A dead-letter topic that exists already and takes less than
// DEAD_LETTER_MAX_BYTES (created by an older version, or by hand) bounds
// the writer's batches: many small dead letters at once are not refused as
// one too-large batch.
func TestDeadLetterExistingSmallTopicBoundsBatches(t *testing.T) {
	t.Parallel()
	real := stack.ElasticsearchURL(t)
	f := newFixture(t, real, real, 1)
	ctx := context.Background()
	dlq := f.cfg.withDefaults().DeadLetterTopic
	require.NoError(t, ensureTopic(ctx, f.cfg.Brokers, dlq, 1, kafka.ConfigEntry{ConfigName: "max.message.bytes", ConfigValue: strconv.Itoa(1 << 20)}))
	var recs []rec
	for i := range 30 { // 30 × 50 KB refused by the strict mapping: 1.5 MB of dead letters in one batch
		recs = append(recs, upsert(fmt.Sprintf("r%d", i), 1, `{"extra":{"color":"`+strings.Repeat("r", 50<<10)+`"}}`))
	}
	f.produce(recs...)
	cfg := f.cfg
	cfg.FlushInterval, cfg.Linger = time.Second, true
	cfg.Lanes = 1
	f.start(cfg)
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	require.Len(t, f.deadLetters(30), 30)
}

// A dead letter as large as the dead-letter writer takes (the main topic
// allowing it) can be replayed too: the replay writer is sized like the
// dead-letter writer, not kafka-go's 1 MiB default.
func TestDeadLetterReplayLargeMessage(t *testing.T) {
	t.Parallel()
	real := stack.ElasticsearchURL(t)
	f := newFixture(t, real, real, 1)
	ctx := context.Background()
	const topicMax = 4 << 20
	f.cfg.Topic = fixtureTopic(t, f, topicMax)
	dlq := f.cfg.withDefaults().DeadLetterTopic
	require.NoError(t, ensureTopic(ctx, f.cfg.Brokers, dlq, 1, deadLetterTopicConfigs(f.cfg.withDefaults())...))

	doc := `{"n":1,"title":"` + strings.Repeat("r", 2<<20) + `"}`
	small := upsert("small", 1, docN(1)).message()
	big := upsert("big", 1, doc).message()
	for _, m := range []*kafka.Message{&small, &big} {
		m.Headers = append(m.Headers, kafka.Header{Key: HeaderDLQTopic, Value: []byte(f.cfg.Topic)})
	}
	w := &kafka.Writer{Addr: kafka.TCP(f.cfg.Brokers...), Topic: dlq, RequiredAcks: kafka.RequireAll, BatchBytes: topicMax}
	defer w.Close()
	require.NoError(t, w.WriteMessages(ctx, small, big))

	res, err := ReplayDeadLetters(ctx, f.cfg)
	require.NoError(t, err)
	require.Equal(t, 2, res.Republished)
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: f.cfg.Brokers, Topic: f.cfg.Topic, Partition: 0, MaxWait: 100 * time.Millisecond})
	defer r.Close()
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var keys []string
	for range 2 {
		m, err := r.FetchMessage(rctx)
		require.NoError(t, err)
		keys = append(keys, string(m.Key))
		if string(m.Key) == "big" {
			require.Equal(t, doc, string(m.Value))
		}
	}
	require.Equal(t, []string{"small", "big"}, keys)
}

// A dead-letter topic created by an older indexer has the broker's
// defaults (retention of days, 1 MiB messages): its dead letters would
// still expire unseen and large ones be refused. What was never set on the
// topic takes the indexer's settings at start; what an operator set on it
// stays.
func TestDeadLetterExistingTopicDefaultsUpgraded(t *testing.T) {
	t.Parallel()
	f := newFixture(t, "http://127.0.0.1:1", "http://127.0.0.1:1", 1)
	ctx := context.Background()
	cfg := f.cfg.withDefaults()
	require.NoError(t, ensureTopic(ctx, cfg.Brokers, cfg.DeadLetterTopic, 1)) // as before: broker defaults
	ix, err := New(f.cfg)
	require.NoError(t, err)
	defer ix.dlq.Close()
	require.NoError(t, ix.ensureDeadLetterTopic(ctx))
	// The broker applies an altered config through its metadata log: a
	// describe right after may still show the old values.
	want := map[string]string{"retention.ms": "-1", "max.message.bytes": strconv.Itoa(cfg.DeadLetterMaxBytes)}
	var conf map[string]string
	require.Eventually(t, func() bool {
		conf, err = topicConfig(ctx, f.kclient, cfg.DeadLetterTopic, "retention.ms", "max.message.bytes")
		return err == nil && maps.Equal(conf, want)
	}, 30*time.Second, 50*time.Millisecond, "dead-letter topic configs: %v (%v)", conf, err)
	require.EqualValues(t, cfg.DeadLetterMaxBytes, ix.dlq.w.BatchBytes)

	// An operator's own value is left as it is (and bounds the writer).
	cfg2 := f.cfg
	cfg2.DeadLetterTopic = stack.UniqueName("dlq-own")
	require.NoError(t, ensureTopic(ctx, cfg.Brokers, cfg2.DeadLetterTopic, 1,
		kafka.ConfigEntry{ConfigName: "retention.ms", ConfigValue: "3600000"}, kafka.ConfigEntry{ConfigName: "max.message.bytes", ConfigValue: "2097152"}))
	ix2, err := New(cfg2)
	require.NoError(t, err)
	defer ix2.dlq.Close()
	require.NoError(t, ix2.ensureDeadLetterTopic(ctx))
	conf, err = topicConfig(ctx, f.kclient, cfg2.DeadLetterTopic, "retention.ms", "max.message.bytes")
	require.NoError(t, err)
	require.Equal(t, map[string]string{"retention.ms": "3600000", "max.message.bytes": "2097152"}, conf)
	require.EqualValues(t, 2097152, ix2.dlq.w.BatchBytes)
}
