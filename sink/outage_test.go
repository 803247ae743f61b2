package sink

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// A delete at version 7 stays effective against a replayed upsert at
// version 6 after index.gc_deletes has passed AND after a restart of the
// search node (which empties the engine's version map), while a plain
// external-versioned DELETE on a control document is forgotten each time.
func TestDeleteSurvivesGCAndNodeRestart(t *testing.T) {
	t.Parallel()
	node := stack.Private(t, "opensearch")
	f := newFixture(t, node.Env, node.Env, 2)
	f.produce(upsert("d", 5, docN(5)), del("d", 7), upsert("keep", 1, docN(1)))
	f.start(f.cfg)
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	index := f.writeIndex()

	plainDelete(t, f.client, index, "control-1", 5, 7)
	waitEngineForgotDelete(t, f.client, index, "control-1")
	f.produce(upsert("d", 6, docN(6)))
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	require.Equal(t, int64(7), f.get("d").Version)

	plainDelete(t, f.client, index, "control-2", 5, 7)
	require.NoError(t, node.Stop())
	require.NoError(t, node.Start())
	waitEngineForgotDelete(t, f.client, index, "control-2")
	f.produce(upsert("d", 6, docN(66)))
	f.waitCaughtUp(f.cfg.Group, 2*time.Minute)

	d := f.get("d")
	require.Equal(t, int64(7), d.Version)
	require.JSONEq(t, string(tombstoneDoc), string(d.Source))
	seen := f.search(f.cfg.Alias)
	require.NotContains(t, seen, "d")
	require.Contains(t, seen, "keep")
}

// The search node is stopped for 30 s mid-stream: committed offsets do not
// move while nothing can be indexed, and once it is back everything is
// indexed with nothing lost.
func TestEngineOutageMidStream(t *testing.T) {
	t.Parallel()
	node := stack.Private(t, "opensearch")
	f := newFixture(t, node.Env, node.Env, 3)
	cfg := f.cfg
	cfg.BatchSize = 50
	cfg.MaxRate = 500 // stretch the stream so the outage hits its middle
	var first []rec
	for i := range 2000 {
		first = append(first, upsert(fmt.Sprintf("o-%04d", i), 1, docN(i)))
	}
	f.produce(first...)
	ix := f.start(cfg)
	eventually(t, time.Minute, func() error {
		if n := committedSum(f.offsets(cfg.Group)); n < 300 {
			return fmt.Errorf("%d committed", n)
		}
		return nil
	})
	require.NoError(t, node.Stop())
	stopped := committedSum(f.offsets(cfg.Group))
	require.Less(t, stopped, int64(2000), "the outage must hit the middle of the stream")
	var second []rec
	for i := range 500 {
		second = append(second, upsert(fmt.Sprintf("o-%04d", i), 2, docN(i+10000)))
	}
	f.produce(second...)

	outageEnd := time.Now().Add(30 * time.Second)
	tick := time.NewTicker(time.Second)
	for time.Now().Before(outageEnd) {
		<-tick.C
		require.Equal(t, stopped, committedSum(f.offsets(cfg.Group)), "offsets moved while the engine was down")
	}
	tick.Stop()
	require.NoError(t, node.Start())

	f.waitCaughtUp(cfg.Group, 2*time.Minute)
	seen := f.search(f.cfg.Alias)
	require.Len(t, seen, 2000)
	for i := range 2000 {
		id := fmt.Sprintf("o-%04d", i)
		want := "v1 " + docN(i)
		if i < 500 {
			want = "v2 " + docN(i+10000)
		}
		require.Equal(t, want, seen[id], id)
	}
	require.Positive(t, counterValue(t, ix.m.retries.WithLabelValues("request")))
}

func committedSum(po []PartitionOffsets) int64 {
	var n int64
	for _, p := range po {
		n += max(p.Committed, 0)
	}
	return n
}
