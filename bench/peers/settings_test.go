package bench_peers

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// TestPartialRunLeavesTheReadme: a run of some legs (BENCH_PEERS_LEGS)
// writes its own directory, says at the top of its table that it is
// partial, has no rows of the legs it left out, and does not rewrite the
// README's block, even when BENCH_PEERS_OUT names bench/results; a full run
// into bench/results does.
func TestPartialRunLeavesTheReadme(t *testing.T) {
	t.Setenv("PGSYNC_BIN", "/nonexistent")
	t.Setenv("REDIS_SERVER", "/nonexistent")
	resultsDir := filepath.Join(stack.RepoRoot(), "bench", "results")

	t.Setenv("BENCH_PEERS_LEGS", "")
	full := load(t)
	require.False(t, full.Partial())
	require.Equal(t, resultsDir, full.Out)
	require.True(t, full.RewritesReadme())
	require.NotContains(t, (&results{Settings: full}).markdown(), "Partial run")

	t.Setenv("BENCH_PEERS_LEGS", "changes, deletes")
	part := load(t)
	require.Equal(t, []string{legChanges, legDeletes}, part.Legs)
	require.True(t, part.Partial())
	require.Equal(t, filepath.Join(resultsDir, "peers-partial"), part.Out)
	require.False(t, part.RewritesReadme())
	md := (&results{Settings: part}).markdown()
	require.Contains(t, md, "**Partial run: only the latency legs changes, deletes")
	require.Contains(t, md, "single-row hard DELETEs at 500/s")
	require.False(t, strings.Contains(md, "outbox.Enqueue events"), md)

	t.Setenv("BENCH_PEERS_OUT", resultsDir)
	part = load(t)
	require.Equal(t, resultsDir, part.Out)
	require.False(t, part.RewritesReadme())
}

// TestReportLegWithNothingSeen: a leg none of whose changes showed in
// searches (a tool that never deletes the documents) is written, as "none
// gone from searches", not lost to a NaN the JSON cannot hold. The first
// try of the deletes leg against a keep job failed here.
func TestReportLegWithNothingSeen(t *testing.T) {
	t.Setenv("PGSYNC_BIN", "/nonexistent")
	t.Setenv("REDIS_SERVER", "/nonexistent")
	t.Setenv("BENCH_PEERS_LEGS", "deletes")
	s := load(t)
	ol := &openLoop{start: time.Now(), interval: 50 * time.Millisecond}
	commits := []time.Time{ol.start, ol.start.Add(50 * time.Millisecond)}
	none := ol.result(20, 2, commits, make([]time.Time, 2))
	none.Tool, none.Kind, none.Round = pgsyncName, kindDeletes, 1
	some := ol.result(20, 2, commits, []time.Time{ol.start.Add(time.Second), ol.start.Add(2 * time.Second)})
	some.Tool, some.Kind, some.Round = ourName, kindDeletes, 1
	require.Equal(t, 2, none.Lost)
	require.Zero(t, some.Lost)
	require.InDelta(t, 1950, some.P99ms, 1)
	s.DeleteRates = []int{20}
	// Two changes, the second committed 50 ms after the start: 40/s.
	r := &results{Settings: s, Legs: []leg{none, some}}
	dir := t.TempDir()
	require.NoError(t, r.write(dir))
	md, err := os.ReadFile(filepath.Join(dir, "peers.md"))
	require.NoError(t, err)
	require.Contains(t, string(md), "| single-row hard DELETEs at 20/s, commit → gone from searches (PGSync `--daemon`; outboxrelay `batcher run --follow`, `vanished: delete`) | none gone from searches within 60 s (40/s committed) | p50 1.00 s / p99 1.95 s (40/s committed) | — |")
	require.Contains(t, string(md), "| 1 | PGSync 7.3.0 | table deletes | 2 at 20/s (40/s committed): all 2 still searchable after 60 s |")
}
