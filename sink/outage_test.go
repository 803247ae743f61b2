package sink

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
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

// signalHandler is a slog.Handler that closes seen when a record with msg
// is logged.
type signalHandler struct {
	msg  string
	once *sync.Once
	seen chan struct{}
}

func (h signalHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h signalHandler) Handle(_ context.Context, r slog.Record) error {
	if r.Message == h.msg {
		h.once.Do(func() { close(h.seen) })
	}
	return nil
}
func (h signalHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h signalHandler) WithGroup(string) slog.Handler      { return h }

// An indexer started while the engine is down waits for it (within its
// retry budget) instead of exiting, then indexes everything.
func TestIndexerWaitsForTheEngineAtStart(t *testing.T) {
	t.Parallel()
	node := stack.Private(t, "opensearch")
	f := newFixture(t, node.Env, node.Env, 2)
	require.NoError(t, node.Stop())
	var recs []rec
	for i := range 200 {
		recs = append(recs, upsert(fmt.Sprintf("s-%03d", i), 1, docN(i)))
	}
	f.produce(recs...)

	cfg := f.cfg
	notReady := signalHandler{msg: "indexer not ready: search engine or broker unavailable; retrying", once: new(sync.Once), seen: make(chan struct{})}
	cfg.Logger = slog.New(notReady)
	f.start(cfg)
	select {
	case <-notReady.seen:
	case <-time.After(time.Minute):
		t.Fatal("the indexer never reported waiting for the engine")
	}
	require.NoError(t, node.Start())
	f.waitCaughtUp(cfg.Group, 2*time.Minute)
	require.Len(t, f.search(cfg.Alias), 200)
}
