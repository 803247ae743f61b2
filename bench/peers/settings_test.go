package bench_peers

import (
	"path/filepath"
	"strings"
	"testing"

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
