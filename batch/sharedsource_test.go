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

// A second job on the same table and source name that feeds another topic
// (or another aggregate type): normalized_records is keyed by (source,
// source_id), so every row it reads is already there at its source and
// processor version, and it would send no event ("300 rows, 0 changed").
// It is refused at start, naming source_name, and nothing changes.
func TestSharedSourceNameWithAnotherTopicIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 1, 300, 1, 3)
	first := spec(func(s *batch.Spec) { s.Job, s.Topic, s.Vanished = "search", "records.search", batch.VanishedKeep })
	_, err := run(t, pool, first, batch.Config{Workers: 1})
	require.NoError(t, err)
	before := count(t, pool, "search")
	require.EqualValues(t, 300, before.Events)

	for _, tc := range []struct {
		name string
		mut  func(*batch.Spec)
	}{
		{"another topic", func(s *batch.Spec) { s.Topic = "records.analytics" }},
		{"another aggregate type", func(s *batch.Spec) { s.AggregateType = "record" }},
	} {
		second := spec(func(s *batch.Spec) { s.Job, s.Topic, s.Vanished = "analytics", "records.search", batch.VanishedKeep }, tc.mut)
		_, err = run(t, pool, second, batch.Config{Workers: 1})
		require.ErrorIs(t, err, batch.ErrSpec, tc.name)
		require.ErrorContains(t, err, "source_name", tc.name)
		require.ErrorContains(t, err, "job search", tc.name)
	}
	require.Equal(t, before.Events, count(t, pool, "search").Events)
	var jobs int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM batch_jobs WHERE job = 'analytics'`).Scan(&jobs))
	require.Zero(t, jobs, "the refused job's spec is not saved")

	// Its own source name: it emits every row to its topic.
	own := spec(func(s *batch.Spec) {
		s.Job, s.Topic, s.Vanished, s.SourceName = "analytics", "records.analytics", batch.VanishedKeep, "source_records.analytics"
	})
	sum, err := run(t, pool, own, batch.Config{Workers: 1})
	require.NoError(t, err)
	require.EqualValues(t, 300, sum.Changed)
	var events int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event_members WHERE topic = 'records.analytics'`).Scan(&events))
	require.Equal(t, 300, events)
}
