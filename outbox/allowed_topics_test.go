package outbox_test

import (
	"context"
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// With Config.Topics (PUBLISHER_TOPICS) set, an event of a topic that is not
// on the list is dead-lettered after TopicWait even though the broker has
// that topic, and none of its records reaches it; the listed topic's
// events, interleaved with them in the same shards, are published.
func TestTopicNotOnTheListIsDeadLettered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	brokers := stack.KafkaBrokers(t)
	pool := stack.Pool(t, stack.Database(t))
	listed := createTopic(t, brokers, 2)
	unlisted := createTopic(t, brokers, 2) // exists, as an auto-created typo would
	const keys = 20
	var evs []outbox.Event
	want := map[string]bool{}
	for k := range keys {
		key := "k" + strconv.Itoa(k)
		for _, topic := range []string{listed, unlisted} {
			e := outbox.Event{ID: outbox.EventID(topic, key, 1, "v1"), Topic: topic, AggregateID: key, AggregateVersion: 1, Payload: json.RawMessage(`{}`)}
			evs = append(evs, e)
			if topic == listed {
				want[e.ID] = true
			}
		}
	}
	_, err := outbox.Enqueue(ctx, pool, evs...)
	require.NoError(t, err)
	startPublisher(t, pool, outbox.Config{Brokers: brokers, TopicWait: 2 * time.Second,
		Topics: []outbox.TopicSpec{{Name: listed, Partitions: 2, ReplicationFactor: 1}}})

	consumeAll(t, brokers, listed, want, time.Minute)
	waitFor(t, time.Minute, "the outbox to drain", func() bool { return outboxCount(t, pool) == 0 })
	dls, err := outbox.ListDeadLetters(ctx, pool, 100)
	require.NoError(t, err)
	require.Len(t, dls, keys, "every event of the unlisted topic is a dead letter")
	for _, d := range dls {
		require.Equal(t, unlisted, d.Topic)
		require.Contains(t, d.Error, `topic "`+unlisted+`"`)
		require.Contains(t, d.Error, "not in PUBLISHER_TOPICS")
	}
	require.Zero(t, topicRecords(t, brokers, unlisted), "no record of the unlisted topic reached the broker")
}

// topicRecords is the number of records in topic (the sum of its
// partitions' end offsets).
func topicRecords(t *testing.T, brokers []string, topic string) int64 {
	t.Helper()
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 30 * time.Second}
	res, err := client.ListOffsets(context.Background(), &kafka.ListOffsetsRequest{
		Topics: map[string][]kafka.OffsetRequest{topic: {kafka.LastOffsetOf(0), kafka.LastOffsetOf(1)}},
	})
	require.NoError(t, err)
	var n int64
	for _, p := range res.Topics[topic] {
		require.NoError(t, p.Error)
		n += p.LastOffset
	}
	return n
}
