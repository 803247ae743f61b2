package sink

import (
	"context"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// Whoever can write the dead-letter topic must not pick where a replay
// writes: a dead letter whose dlq_topic header names a topic other than
// the one this indexer consumes is refused and reported (partition,
// offset, topic), not sent, and neither is what follows it in its
// partition (its progress stops there, so nothing is skipped). --to sends
// them to the consumed topic once an operator has looked; --to naming any
// other topic is refused before anything is read.
func TestDeadLetterReplayOnlyToTheConsumedTopic(t *testing.T) {
	t.Parallel()
	f := newFixture(t, "http://127.0.0.1:1", "http://127.0.0.1:1", 1)
	ctx := context.Background()
	dlq := f.cfg.withDefaults().DeadLetterTopic
	require.NoError(t, ensureTopic(ctx, f.cfg.Brokers, dlq, 1))
	victim := stack.UniqueName("victim")
	require.NoError(t, ensureTopic(ctx, f.cfg.Brokers, victim, 1))

	dead := func(key, topic string) kafka.Message {
		m := upsert(key, 1, docN(1)).message()
		m.Headers = append(m.Headers, kafka.Header{Key: HeaderDLQTopic, Value: []byte(topic)})
		return m
	}
	w := &kafka.Writer{Addr: kafka.TCP(f.cfg.Brokers...), Topic: dlq, RequiredAcks: kafka.RequireAll, BatchTimeout: 2 * time.Millisecond}
	defer w.Close()
	require.NoError(t, w.WriteMessages(ctx, dead("k0", f.cfg.Topic), dead("k1", victim), dead("k2", f.cfg.Topic)))

	end := func(topic string) int64 {
		t.Helper()
		po, err := topicOffsets(ctx, f.kclient, topic, "none")
		require.NoError(t, err)
		n := int64(0)
		for _, p := range po {
			n += p.End
		}
		return n
	}
	keys := func(topic string) []string {
		t.Helper()
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: f.cfg.Brokers, Topic: topic, Partition: 0, MaxWait: 100 * time.Millisecond})
		defer r.Close()
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		var out []string
		for n := end(topic); int64(len(out)) < n; {
			m, err := r.FetchMessage(rctx)
			require.NoError(t, err)
			out = append(out, string(m.Key))
		}
		return out
	}

	for range 2 { // again: still refused, nothing more sent
		res, err := ReplayDeadLetters(ctx, f.cfg)
		require.Error(t, err)
		require.Contains(t, err.Error(), dlq+"/0@1")
		require.Contains(t, err.Error(), `"`+victim+`"`)
		require.Contains(t, err.Error(), "--to "+f.cfg.Topic)
		require.Equal(t, []RefusedDeadLetter{{Partition: 0, Offset: 1, Topic: victim}}, res.Refused)
		require.Equal(t, []string{"k0"}, keys(f.cfg.Topic))
		require.Zero(t, end(victim), "the replay wrote to the topic a dead letter named")
	}

	_, err := ReplayDeadLettersWith(ctx, f.cfg, ReplayOptions{To: victim})
	require.ErrorContains(t, err, "--to="+victim)
	require.Zero(t, end(victim))
	require.Equal(t, []string{"k0"}, keys(f.cfg.Topic))

	res, err := ReplayDeadLettersWith(ctx, f.cfg, ReplayOptions{To: f.cfg.Topic})
	require.NoError(t, err)
	require.Equal(t, 2, res.Republished)
	require.Empty(t, res.Refused)
	require.Equal(t, []string{"k0", "k1", "k2"}, keys(f.cfg.Topic))
	require.Zero(t, end(victim))
}
