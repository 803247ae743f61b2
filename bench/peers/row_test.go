package bench_peers

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRowSkipsQuarantinedRows: the writers change only rows the demo
// normalizer accepts, each once per table's worth of changes. The first
// bench-peers run counted a quarantined row (g=70000) as a change that never
// became searchable.
func TestRowSkipsQuarantinedRows(t *testing.T) {
	for _, rows := range []int64{3000, 100_000, 1_000_000} {
		valid := rows - rows/badEvery
		seen := make(map[int64]bool, valid)
		for k := range valid {
			g := row(k, rows)
			require.True(t, g >= 1 && g <= rows, "rows %d: k %d → g %d", rows, k, g)
			require.NotZero(t, g%badEvery, "rows %d: k %d → quarantined row g %d", rows, k, g)
			require.False(t, seen[g], "rows %d: k %d → g %d twice", rows, k, g)
			seen[g] = true
		}
	}
}
