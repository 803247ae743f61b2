package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// The leader broker of a busy partition is SIGKILLed while the publisher
// sends, on a 3-broker cluster (replication 3, min.insync.replicas 2), and
// started again: every event reaches the topic, per-key order holds on
// every partition, the publisher dead-letters nothing, and the index ends
// with every key at its last version.
func TestPublisherSurvivesLeaderFailover(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "outboxrelay-kafka-cluster-")
	require.NoError(t, err)
	cluster := &stack.Server{Kind: "kafka-cluster", Dir: dir}
	require.NoError(t, cluster.Start())
	// Purge before removing the state dirs: the scripts find their JVMs
	// through them (removed first, the brokers outlived the test binary).
	t.Cleanup(func() { _ = cluster.Purge(); _ = os.RemoveAll(dir) })
	brokers := strings.Split(cluster.Env, ",")

	p := newPipeline(t, pipelineOptions{TopicPartitions: 1})
	p.brokers = brokers
	const partitions = 3
	c := createReplicatedTopic(ctx, t, brokers, p.topic, partitions)

	// keys × versions events, enqueued in commit order (version 1 of every
	// key, then version 2, …) in small transactions, so the publisher is
	// busy when the leader dies.
	const keys, versions = 200, 40
	enqueue := func(v int) {
		evs := make([]outbox.Event, 0, keys)
		for k := range keys {
			id := fmt.Sprintf("k%03d", k)
			evs = append(evs, outbox.Event{ID: outbox.EventID("failover", id, int64(v), "v1"), Topic: p.topic, AggregateType: "failover",
				AggregateID: id, AggregateVersion: int64(v), Payload: json.RawMessage(fmt.Sprintf(`{"title":"%s v%d"}`, id, v))})
		}
		_, err := outbox.Enqueue(ctx, p.pool, evs...)
		require.NoError(t, err)
	}
	for v := 1; v <= versions/4; v++ {
		enqueue(v)
	}
	pub := p.startPublisher("LOG_LEVEL=warn", "KAFKA_BROKERS="+cluster.Env, "BATCH_SIZE=200")
	ix := p.startIndexer("LOG_LEVEL=warn", "KAFKA_BROKERS="+cluster.Env)
	procs := func() string { return "publisher:\n" + tail(pub.Stderr(), 20) + "\nindexer:\n" + tail(ix.Stderr(), 20) }

	// The leader of partition 0 once records flow.
	waitFor(t, time.Minute, "records on the topic", func() bool { return endOffsets(ctx, t, c, p.topic, partitions) > 0 })
	md, err := c.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{p.topic}})
	require.NoError(t, err)
	leader := md.Topics[0].Partitions[0].Leader.ID
	for v := versions/4 + 1; v <= versions; v++ {
		enqueue(v)
	}
	inFlight := p.outboxBacklog(ctx)
	before := endOffsets(ctx, t, c, p.topic, partitions)
	node := &stack.Server{Kind: "kafka", Dir: filepath.Join(dir, "kafka-cluster", "node-"+strconv.Itoa(leader))}
	pidBytes, err := os.ReadFile(filepath.Join(node.Dir, "kafka", "kafka.pid"))
	require.NoError(t, err)
	pid, err := strconv.Atoi(strings.TrimSpace(string(pidBytes)))
	require.NoError(t, err)
	killedAt := time.Now()
	require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))

	// Publishing resumes on the new leaders while the node is down.
	waitFor(t, 2*time.Minute, "publishing to resume after the kill", func() bool { return endOffsets(ctx, t, c, p.topic, partitions) > before+keys })
	resumed := time.Since(killedAt)
	require.NoError(t, node.Start())
	// Drained and consumed (these events have no normalized_records rows,
	// so reconcile does not apply; the index is checked key by key below).
	waitFor(t, 4*time.Minute, "the outbox to drain and the indexer to catch up", func() bool {
		if p.outboxBacklog(ctx) > 0 {
			return false
		}
		st, err := p.status(ctx)
		return err == nil && st.TotalLag() == 0
	})

	pubDL, ixDL := p.deadLetters(ctx)
	require.Zero(t, pubDL, "publisher dead letters caused by the leader change")
	require.Zero(t, ixDL, "indexer dead letters")

	// Every version of every key is on the topic, and on every partition
	// the first appearance of a key's versions is in commit order (a resend
	// repeats records, it never puts a new version before an older one).
	order := readTopicOrder(ctx, t, brokers, c, p.topic, partitions)
	seen, dups, backwards := order.seen, order.dups, order.backwards
	require.Len(t, seen, keys)
	for key, vs := range seen {
		require.Len(t, vs, versions, "key %s: versions on the topic", key)
	}
	docs := p.readIndex(ctx)
	for key := range seen {
		require.EqualValues(t, versions, docs[key].Version, "key %s is stale in the index\n%s", key, procs())
	}
	report(t, "leader failover: broker %d SIGKILLed with %d events in the outbox; publishing resumed %s after the kill; %d duplicate records absorbed; %d events; %d version(s) first seen after a newer one",
		leader, inFlight, resumed.Round(time.Millisecond), dups, keys*versions, len(backwards))
	require.Zerof(t, len(backwards), "versions first seen after a newer one; first: %s", strings.Join(backwards[:min(5, len(backwards))], "; "))
}

func endOffsets(ctx context.Context, t *testing.T, c *kafka.Client, topic string, partitions int) int64 {
	var n int64
	for p := range partitions {
		n += partitionEnd(ctx, t, c, topic, p)
	}
	return n
}

func partitionEnd(ctx context.Context, t *testing.T, c *kafka.Client, topic string, partition int) int64 {
	t.Helper()
	res, err := c.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: {kafka.LastOffsetOf(partition)}}})
	if err != nil {
		return 0 // a leader change in progress: the caller polls again
	}
	for _, po := range res.Topics[topic] {
		if po.Error == nil {
			return po.LastOffset
		}
	}
	return 0
}

// waitFor polls cond until it holds or d passes; a timeout prints what
// each diag returns then (process logs, cluster state), so a wait that
// failed under load leaves its cause in the log.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool, diag ...func() string) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			var state strings.Builder
			for _, f := range diag {
				state.WriteString("\n")
				state.WriteString(f())
			}
			require.FailNowf(t, "timed out", "after %s waiting for %s%s", d, what, state.String())
		}
		pause(context.Background(), 200*time.Millisecond)
	}
}
