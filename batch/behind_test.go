package batch_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
)

// CountBehind compares the job's scope as the batcher scans it (filter,
// explicit partition list) with normalized_records: changes outside the
// scope do not count, rows that enter it are missing, rows that leave it
// are gone, and a new run brings the count back to zero.
func TestCountBehindFollowsTheScope(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 0, 300, 1, 3) // id = 7g, tenant t(g%3)
	s := spec(func(s *batch.Spec) {
		s.Source.Partition = "tenant_id"
		s.Source.Partitions = []string{"t0", "t1"}
		s.Source.Filter = []batch.Condition{{Column: "id", Op: ">=", Value: "70"}}
	})
	_, err := run(t, pool, s, batch.Config{Workers: 2})
	require.NoError(t, err)
	b, err := batch.CountBehind(ctx, pool, s)
	require.NoError(t, err)
	require.Zero(t, b.Total(), "%+v", b)

	for _, sql := range []string{
		`UPDATE source_records SET payload = payload || '{"title": "x"}' WHERE id = 210`, // t0, in scope: changed
		`UPDATE source_records SET payload = payload || '{"title": "x"}' WHERE id = 21`,  // filtered out
		`UPDATE source_records SET payload = payload || '{"title": "x"}' WHERE id = 224`, // t2, not listed
		`UPDATE source_records SET deleted_at = now() WHERE id = 217`,                    // t1, soft-deleted: changed
		`UPDATE source_records SET tenant_id = 't2' WHERE id = 238`,                      // t1 -> t2: gone
		`UPDATE source_records SET tenant_id = 't0' WHERE id = 245`,                      // t2 -> t0: missing
		`DELETE FROM source_records WHERE id = 14`,                                       // filtered out
	} {
		tag, err := pool.Exec(ctx, sql)
		require.NoError(t, err)
		require.EqualValues(t, 1, tag.RowsAffected(), sql)
	}
	seed(t, pool, 300, 1, 1, 3) // id 2100, t0: missing
	b, err = batch.CountBehind(ctx, pool, s)
	require.NoError(t, err)
	require.Equal(t, batch.Behind{Changed: 2, Missing: 2, Gone: 1}, b)

	// Another processor version's rows are not counted (not rebuilt yet).
	v2 := s
	v2.ProcessorVersion = "v2"
	b, err = batch.CountBehind(ctx, pool, v2)
	require.NoError(t, err)
	require.Equal(t, batch.Behind{Missing: 2}, b, "only the rows without any normalized row")

	_, err = run(t, pool, s, batch.Config{Workers: 2})
	require.NoError(t, err)
	b, err = batch.CountBehind(ctx, pool, s)
	require.NoError(t, err)
	require.Zero(t, b.Total(), "%+v", b)
}
