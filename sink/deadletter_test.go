package sink

import (
	"context"
	"fmt"
	"testing"
	"time"

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
