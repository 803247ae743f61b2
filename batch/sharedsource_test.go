package batch_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
)

// Two jobs that write one source name with different scopes: the sweep of
// either one's full run would turn the other's rows into deletes, so the
// second job to start is refused, naming the first, and nothing is deleted.
// A job over the same scope (an incremental job beside the full one) may
// share the source name.
func TestSharedSourceNameWithAnotherScopeIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := newDB(t)
	seed(t, pool, 1, 300, 1, 3) // tenants t0..t2
	only := func(job, tenant string) batch.Spec {
		return spec(func(s *batch.Spec) {
			s.Job = job
			s.SourceName = "articles"
			s.Source.Filter = []batch.Condition{{Column: "tenant_id", Op: "=", Value: tenant}}
		})
	}
	_, err := run(t, pool, only("kr", "t0"), batch.Config{Workers: 1})
	require.NoError(t, err)

	for _, vanished := range []string{batch.VanishedDelete, batch.VanishedKeep} {
		jp := only("jp", "t1")
		jp.Vanished = vanished
		_, err = run(t, pool, jp, batch.Config{Workers: 1})
		require.ErrorIs(t, err, batch.ErrSpec, "vanished: %s", vanished)
		require.ErrorContains(t, err, `"articles"`)
		require.ErrorContains(t, err, "job kr")
	}
	require.Empty(t, deleteEvents(t, url))
	var live int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM normalized_records WHERE source = 'articles' AND NOT deleted`).Scan(&live))
	require.Equal(t, 100, live)

	// The same scope (another job, an "in" list in another order) shares.
	same := only("kr-again", "t0")
	_, err = run(t, pool, same, batch.Config{Workers: 1})
	require.NoError(t, err)
	in := func(job string, tenants ...string) batch.Spec {
		return spec(func(s *batch.Spec) {
			s.Job = job
			s.SourceName = "asia"
			s.Source.Filter = []batch.Condition{{Column: "tenant_id", Op: "in", Values: tenants}}
		})
	}
	_, err = run(t, pool, in("asia-1", "t1", "t2"), batch.Config{Workers: 1})
	require.NoError(t, err)
	_, err = run(t, pool, in("asia-2", "t2", "t1"), batch.Config{Workers: 1})
	require.NoError(t, err)
	require.Empty(t, deleteEvents(t, url))
}
