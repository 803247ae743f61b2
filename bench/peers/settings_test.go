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

// TestPartialRunLeavesTheBenchmarksPage: a run of some legs (BENCH_PEERS_LEGS)
// writes its own directory, says at the top of its table that it is
// partial, has no rows of the legs it left out, and does not rewrite the
// block in docs/benchmarks.md, even when BENCH_PEERS_OUT names bench/results; a full run
// into bench/results does.
func TestPartialRunLeavesTheBenchmarksPage(t *testing.T) {
	t.Setenv("PGSYNC_BIN", "/nonexistent")
	t.Setenv("REDIS_SERVER", "/nonexistent")
	resultsDir := filepath.Join(stack.RepoRoot(), "bench", "results")

	t.Setenv("BENCH_PEERS_LEGS", "")
	full := load(t)
	require.False(t, full.Partial())
	require.Equal(t, resultsDir, full.Out)
	require.True(t, full.RewritesBenchmarksPage())
	require.NotContains(t, (&results{Settings: full}).markdown(), "Partial run")

	t.Setenv("BENCH_PEERS_LEGS", "changes, deletes")
	part := load(t)
	require.Equal(t, []string{legChanges, legDeletes}, part.Legs)
	require.True(t, part.Partial())
	require.Equal(t, filepath.Join(resultsDir, "peers-partial"), part.Out)
	require.False(t, part.RewritesBenchmarksPage())
	md := (&results{Settings: part}).markdown()
	require.Contains(t, md, "**Partial run: only the latency legs changes, deletes")
	require.Contains(t, md, "single-row hard DELETEs at 500/s")
	require.False(t, strings.Contains(md, "outbox.Enqueue events"), md)

	t.Setenv("BENCH_PEERS_OUT", resultsDir)
	part = load(t)
	require.Equal(t, resultsDir, part.Out)
	require.False(t, part.RewritesBenchmarksPage())
}

// TestUpdateBenchmarksPage: a full run's table goes between the
// bench-peers markers of docs/benchmarks.md, with its plots linked from
// the page's directory, and nothing outside the markers changes; a page
// without the markers is an error, not a page left as it was.
func TestUpdateBenchmarksPage(t *testing.T) {
	orig, err := os.ReadFile(filepath.Join(stack.RepoRoot(), "docs", "benchmarks.md"))
	require.NoError(t, err)
	const begin, end = "<!-- bench-peers:begin -->\n", "<!-- bench-peers:end -->"
	i, j := strings.Index(string(orig), begin), strings.Index(string(orig), end)
	require.True(t, i >= 0 && j > i, "docs/benchmarks.md has no bench-peers markers")

	page := filepath.Join(t.TempDir(), "benchmarks.md")
	require.NoError(t, os.WriteFile(page, orig, 0o644))
	table := "| measurement | peer |\n|---|---|\n\n![throughput](peers-throughput.png) ![latency](peers-latency.png)\n"
	require.NoError(t, updateBenchmarksPage(page, filepath.Join("..", "bench", "results"), table))
	got, err := os.ReadFile(page)
	require.NoError(t, err)
	want := string(orig[:i+len(begin)]) +
		"| measurement | peer |\n|---|---|\n\n![throughput](../bench/results/peers-throughput.png) ![latency](../bench/results/peers-latency.png)\n" +
		string(orig[j:])
	require.Equal(t, want, string(got))

	bare := filepath.Join(t.TempDir(), "README.md")
	require.NoError(t, os.WriteFile(bare, []byte("# no markers\n"), 0o644))
	require.ErrorContains(t, updateBenchmarksPage(bare, "bench/results", table), "no \"<!-- bench-peers:begin -->\"")
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

// TestReportRelationsRows: a relations-only run reports the catalog's
// rows (initial sync with CPU, variant UPDATEs per rate, the shared brand's
// rename with its first document) for both tools with their ratios, and
// neither the bench-e2e rows' initial sync it did not run nor their count.
func TestReportRelationsRows(t *testing.T) {
	t.Setenv("PGSYNC_BIN", "/nonexistent")
	t.Setenv("REDIS_SERVER", "/nonexistent")
	t.Setenv("BENCH_PEERS_LEGS", "relations")
	t.Setenv("BENCH_PEERS_REL_PRODUCTS", "20000")
	t.Setenv("BENCH_PEERS_REL_RATES", "50")
	s := load(t)
	require.False(t, s.RunsRecords())
	require.True(t, s.Partial())
	ol := &openLoop{start: time.Now(), interval: 20 * time.Millisecond}
	commits := []time.Time{ol.start, ol.start.Add(20 * time.Millisecond)}
	slow := ol.result(50, 2, commits, []time.Time{ol.start.Add(4 * time.Second), ol.start.Add(8 * time.Second)})
	slow.Tool, slow.Kind, slow.Round = pgsyncName, kindRelChanges, 1
	fast := ol.result(50, 2, commits, []time.Time{ol.start.Add(time.Second), ol.start.Add(2 * time.Second)})
	fast.Tool, fast.Kind, fast.Round = ourName, kindRelChanges, 1
	r := &results{Settings: s, Rows: s.Rows, Rounds: 1, Legs: []leg{
		{Tool: pgsyncName, Kind: kindRelInitial, Round: 1, Docs: 20000, Seconds: 20, ProcessCPU: 8},
		{Tool: ourName, Kind: kindRelInitial, Round: 1, Docs: 20000, Seconds: 5, ProcessCPU: 1},
		{Tool: pgsyncName, Kind: kindRelRename, Round: 1, Docs: 10000, Seconds: 40, FirstSeconds: 30},
		{Tool: ourName, Kind: kindRelRename, Round: 1, Docs: 10000, Seconds: 10, FirstSeconds: 2},
		slow, fast,
	}}
	dir := t.TempDir()
	require.NoError(t, r.write(dir))
	raw, err := os.ReadFile(filepath.Join(dir, "peers.md"))
	require.NoError(t, err)
	md := string(raw)
	require.Contains(t, md, "; relations: a catalog of 20000 products, 100000 variants, brand 1 shared by 10000 products, 1 round(s)")
	require.Contains(t, md, "**Partial run: only the latency legs relations (BENCH_PEERS_LEGS); not the table of docs/benchmarks.md.**")
	require.NotContains(t, md, "bench-e2e seed")
	require.NotContains(t, md, "| initial sync, source → all searchable")
	require.Contains(t, md, "→ all searchable (PGSync `children`; outboxrelay `document.relations`, incremental) | 20.0 s (1000 docs/s), CPU 8.0 s | 5.0 s (4000 docs/s), CPU 1.0 s | **0.25×** time |")
	require.Contains(t, md, "| relations: variant UPDATEs at 50/s, commit → its product searchable with the change (PGSync `--daemon`; outboxrelay `batcher run --follow`) | p50 4.00 s / p99 7.98 s (100/s committed) | p50 1.00 s / p99 1.98 s (100/s committed) | **0.25×** p99 |")
	require.Contains(t, md, "| relations: brand shared by 10000 products renamed, commit → all of them searchable with the new name | 40.00 s (the first after 30.00 s) | 10.00 s (the first after 2.00 s) | **0.25×** time |")
	require.Contains(t, md, "| 1 | outboxrelay | relations: shared brand renamed | 10000 products searchable with the new brand name 10.00 s after the commit (the first after 2.00 s) |")
	for _, f := range []string{"peers-throughput.png", "peers-latency.png"} {
		st, err := os.Stat(filepath.Join(dir, f))
		require.NoError(t, err)
		require.Positive(t, st.Size(), f)
	}
}
