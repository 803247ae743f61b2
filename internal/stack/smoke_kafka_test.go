package stack_test

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

func createTopic(t *testing.T, brokers []string, topic string, partitions int) {
	t.Helper()
	conn, err := kafka.Dial("tcp", brokers[0])
	require.NoError(t, err)
	defer conn.Close()
	ctrl, err := conn.Controller()
	require.NoError(t, err)
	cc, err := kafka.Dial("tcp", net.JoinHostPort(ctrl.Host, strconv.Itoa(ctrl.Port)))
	require.NoError(t, err)
	defer cc.Close()
	require.NoError(t, cc.CreateTopics(kafka.TopicConfig{Topic: topic, NumPartitions: partitions, ReplicationFactor: 1}))
}

type seen struct {
	partition int
	offset    int64
}

// The broker does what the publisher and indexer rely on: acks=all writes,
// per-key order within a partition, consumer groups with manual commits that
// hand the uncommitted tail to the next member.
func TestSmokeKafkaKeyedOrderAndManualCommits(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	brokers := stack.KafkaBrokers(t)
	if out, err := exec.Command("bash", filepath.Join(stack.RepoRoot(), "scripts/stack/kafka.sh"), "version").Output(); err == nil {
		t.Logf("Kafka broker: %s at %v", strings.TrimSpace(string(out)), brokers)
	}
	topic := stack.UniqueName("smoke")
	createTopic(t, brokers, topic, 3)

	const total, keys = 10_000, 100
	w := &kafka.Writer{
		Addr: kafka.TCP(brokers...), Topic: topic, Balancer: &kafka.Hash{},
		RequiredAcks: kafka.RequireAll, BatchSize: 1000, BatchTimeout: 5 * time.Millisecond,
	}
	msgs := make([]kafka.Message, total)
	for i := range msgs {
		k := i % keys
		msgs[i] = kafka.Message{Key: []byte(fmt.Sprintf("key-%03d", k)), Value: []byte(strconv.Itoa(i / keys))}
	}
	require.NoError(t, w.WriteMessages(ctx, msgs...))
	require.NoError(t, w.Close())

	group := stack.UniqueName("smoke-group")
	newReader := func() *kafka.Reader {
		return kafka.NewReader(kafka.ReaderConfig{
			Brokers: brokers, GroupID: group, Topic: topic, StartOffset: kafka.FirstOffset,
			MaxWait: 100 * time.Millisecond, CommitInterval: 0, // manual, synchronous commits
		})
	}

	r1 := newReader()
	lastSeq := map[string]int{}
	var fetched []kafka.Message
	for len(fetched) < total {
		m, err := r1.FetchMessage(ctx)
		require.NoError(t, err)
		seq, err := strconv.Atoi(string(m.Value))
		require.NoError(t, err)
		if prev, ok := lastSeq[string(m.Key)]; ok {
			require.Greater(t, seq, prev, "per-key order broken for %s", m.Key)
		}
		lastSeq[string(m.Key)] = seq
		fetched = append(fetched, m)
	}
	require.Len(t, lastSeq, keys)
	for k, s := range lastSeq {
		require.Equal(t, total/keys-1, s, "key %s incomplete", k)
	}

	// Commit only the first 9,000 fetched; the rest is the uncommitted tail.
	committed := fetched[:9000]
	require.NoError(t, r1.CommitMessages(ctx, committed...))
	committedTo := map[int]int64{}
	for _, m := range committed {
		committedTo[m.Partition] = max(committedTo[m.Partition], m.Offset+1)
	}
	want := map[seen]bool{}
	for _, m := range fetched {
		if m.Offset >= committedTo[m.Partition] {
			want[seen{m.Partition, m.Offset}] = true
		}
	}
	require.NotEmpty(t, want)
	require.NoError(t, r1.Close())

	r2 := newReader()
	defer r2.Close()
	got := map[seen]bool{}
	for len(got) < len(want) {
		m, err := r2.FetchMessage(ctx)
		require.NoError(t, err)
		s := seen{m.Partition, m.Offset}
		require.True(t, want[s], "the second reader got committed message %v", s)
		got[s] = true
	}
	require.Equal(t, want, got)
}
