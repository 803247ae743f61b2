package batch_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
)

// A run that waits for an open writer of the source table starts as soon
// as that writer ends: the wait must not look at one frozen picture of the
// server's backends.
func TestRunStartsWhenTheOpenWriterEnds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 0, 100, 3, 1)
	s := spec(func(s *batch.Spec) { s.Job = "records-wait" })

	writer, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer writer.Rollback(ctx)
	_, err = writer.Exec(ctx, `UPDATE source_records SET payload = jsonb_set(payload, '{title}', '"open"') WHERE id = 7`)
	require.NoError(t, err)

	r, err := batch.NewRunner(pool, s, batch.Config{})
	require.NoError(t, err)
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	prepared := make(chan error, 1)
	go func() {
		_, err := r.Prepare(pctx)
		prepared <- err
	}()
	// The run is waiting for the writer (its prepare transaction is open).
	require.Eventually(t, func() bool {
		var waiting int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle in transaction' AND query LIKE '%l.virtualtransaction = ANY%'`).Scan(&waiting)
		return waiting > 0
	}, 20*time.Second, 20*time.Millisecond, "the run waits for the open writer")
	require.NoError(t, writer.Commit(ctx))
	select {
	case err := <-prepared:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("the run did not start within 10s of the writer's commit")
	}
}
