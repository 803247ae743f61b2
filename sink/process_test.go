package sink

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// Three real indexer processes share one group; one is SIGKILLed
// mid-stream. After the rebalance every message is indexed.
func TestThreeIndexersOneKilled(t *testing.T) {
	t.Parallel()
	bin := testproc.Build(t, "indexer")
	es := stack.ElasticsearchURL(t)
	f := newFixture(t, es, es, 6)
	const ids = 1000
	var recs []rec
	for v := int64(1); v <= 3; v++ {
		for i := range ids {
			recs = append(recs, upsert(fmt.Sprintf("p-%04d", i), v, docN(i*10+int(v))))
		}
	}
	f.produce(recs...)
	env := []string{
		"KAFKA_BROKERS=" + strings.Join(f.cfg.Brokers, ","),
		"ELASTICSEARCH_URL=" + es,
		"TOPIC=" + f.cfg.Topic,
		"GROUP=" + f.cfg.Group,
		"ALIAS=" + f.cfg.Alias,
		"BATCH_SIZE=50",
		"FLUSH_INTERVAL=20ms",
		"MAX_RATE=100", // per process: the stream lasts long enough to kill one in the middle
		"SESSION_TIMEOUT=6s",
		"HEARTBEAT_INTERVAL=1s",
		"METRICS_ADDR=",
		"LOG_FORMAT=json",
	}
	procs := make([]*testproc.Proc, 3)
	for i := range procs {
		procs[i] = testproc.Start(t, bin, env, "run")
	}
	eventually(t, time.Minute, func() error {
		n, err := groupMembers(f, f.cfg.Group)
		if err != nil || n != 3 {
			return fmt.Errorf("%d members (%v)", n, err)
		}
		if c := committedSum(f.offsets(f.cfg.Group)); c < 300 {
			return fmt.Errorf("%d committed", c)
		}
		return nil
	})
	require.Less(t, committedSum(f.offsets(f.cfg.Group)), int64(len(recs)), "the kill must hit the middle of the stream")
	require.NoError(t, procs[1].Signal(syscall.SIGKILL))
	_ = procs[1].Wait(10 * time.Second)
	require.True(t, procs[1].Killed())

	f.waitCaughtUp(f.cfg.Group, 3*time.Minute)
	seen := f.search(f.cfg.Alias)
	require.Len(t, seen, ids)
	for i := range ids {
		id := fmt.Sprintf("p-%04d", i)
		require.Equal(t, "v3 "+docN(i*10+3), seen[id], id)
	}
	for _, i := range []int{0, 2} {
		require.Equal(t, -1, procs[i].ExitCode(), "indexer %d exited early:\n%s", i, procs[i].Stderr())
		require.NoError(t, procs[i].Signal(syscall.SIGTERM))
		require.NoError(t, procs[i].Wait(30*time.Second), procs[i].Stderr())
	}

	// `indexer status` reads the same state from Kafka and the engine.
	st := testproc.Run(t, time.Minute, bin, env, "status")
	require.Zero(t, st.ExitCode(), st.Stderr())
	out := st.Stdout()
	require.Contains(t, out, "total lag: 0")
	require.Contains(t, out, "dead-letter topic "+f.cfg.Topic+".dlq: 0 message(s)")
	require.Contains(t, out, "read alias "+f.cfg.Alias+" -> ["+f.cfg.Alias+"_v1]")
}

func groupMembers(f *fixture, group string) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	res, err := f.kclient.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: []string{group}})
	if err != nil {
		return 0, err
	}
	if len(res.Groups) != 1 {
		return 0, fmt.Errorf("%d groups", len(res.Groups))
	}
	if res.Groups[0].GroupState != "Stable" {
		return 0, fmt.Errorf("group %s", res.Groups[0].GroupState)
	}
	return len(res.Groups[0].Members), res.Groups[0].Error
}
