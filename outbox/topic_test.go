package outbox_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// topicExists asks the broker (metadata without auto-creation) whether
// topic exists.
func topicExists(t *testing.T, brokers []string, topic string) bool {
	t.Helper()
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 30 * time.Second, Transport: &kafka.Transport{}}
	meta, err := client.Metadata(context.Background(), &kafka.MetadataRequest{Topics: []string{topic}})
	require.NoError(t, err)
	for _, mt := range meta.Topics {
		if mt.Name == topic && mt.Error == nil {
			return true
		}
	}
	return false
}

// Events for a topic that does not exist (a typo) neither create it nor
// stop their shard: the other topic's events, interleaved with them in the
// same shards and batches, are published; the typo's events wait TopicWait
// and then go to outbox_dead_letters with an error that names the topic,
// and later ones follow them there. `topics ensure` creates a topic with
// the partitions asked for and reports a topic that exists with others.
func TestMissingTopicIsDeadLetteredNotCreated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	brokers := stack.KafkaBrokers(t)
	pool := stack.Pool(t, stack.Database(t))
	good := createTopic(t, brokers, 2)
	typo := stack.UniqueName("outbox-typo")
	const keys = 20
	var evs []outbox.Event
	want := map[string]bool{}
	for k := range keys {
		key := "k" + string(rune('a'+k))
		for _, topic := range []string{good, typo} {
			e := outbox.Event{ID: outbox.EventID(topic, key, 1, "v1"), Topic: topic, AggregateID: key, AggregateVersion: 1, Payload: json.RawMessage(`{}`)}
			evs = append(evs, e)
			if topic == good {
				want[e.ID] = true
			}
		}
	}
	_, err := outbox.Enqueue(ctx, pool, evs...)
	require.NoError(t, err)
	startPublisher(t, pool, outbox.Config{Brokers: brokers, TopicWait: 3 * time.Second})

	consumeAll(t, brokers, good, want, time.Minute)
	waitFor(t, time.Minute, "the outbox to drain", func() bool { return outboxCount(t, pool) == 0 })
	dls, err := outbox.ListDeadLetters(ctx, pool, 100)
	require.NoError(t, err)
	require.Len(t, dls, keys, "every event of the missing topic is a dead letter")
	for _, d := range dls {
		require.Equal(t, typo, d.Topic)
		require.Contains(t, d.Error, `topic "`+typo+`" unavailable`)
		require.Contains(t, d.Error, "Unknown Topic Or Partition")
		require.NotNil(t, d.ErrorCode)
		require.EqualValues(t, 3, *d.ErrorCode, "UNKNOWN_TOPIC_OR_PARTITION")
	}
	require.False(t, topicExists(t, brokers, typo), "the publisher does not create topics")

	// Later events of the missing topic go to the dead letters too, and the
	// good topic goes on.
	later := []outbox.Event{
		{ID: outbox.EventID(typo, "ka", 2, "v1"), Topic: typo, AggregateID: "ka", AggregateVersion: 2, Payload: json.RawMessage(`{}`)},
		{ID: outbox.EventID(good, "ka", 2, "v1"), Topic: good, AggregateID: "ka", AggregateVersion: 2, Payload: json.RawMessage(`{}`)},
	}
	_, err = outbox.Enqueue(ctx, pool, later...)
	require.NoError(t, err)
	consumeAll(t, brokers, good, map[string]bool{later[1].ID: true}, time.Minute)
	waitFor(t, time.Minute, "the outbox to drain", func() bool { return outboxCount(t, pool) == 0 })
	dls, err = outbox.ListDeadLetters(ctx, pool, 100)
	require.NoError(t, err)
	require.Len(t, dls, keys+1)

	res, err := outbox.EnsureTopics(ctx, nil, brokers, []outbox.TopicSpec{
		{Name: typo, Partitions: 4, ReplicationFactor: 1},
		{Name: good, Partitions: 3, ReplicationFactor: 1},
	})
	require.NoError(t, err)
	require.True(t, res[0].Created)
	require.NoError(t, res[0].Err)
	require.Equal(t, 4, res[0].Partitions)
	require.False(t, res[1].Created)
	require.ErrorIs(t, res[1].Err, outbox.ErrTopicMismatch, "good has 2 partitions, not 3")
	require.Equal(t, 2, res[1].Partitions)
	require.True(t, topicExists(t, brokers, typo))
}
