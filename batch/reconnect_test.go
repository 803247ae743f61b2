package batch_test

import (
	"context"
	"log/slog"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/migrate"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// A chunk whose backend is terminated (an operator's pg_terminate_backend,
// a failover) rolled back with its session: it is retried on a new
// connection, and the run ends with the exact result.
func TestChunkRetriesOnANewConnectionAfterItsBackendIsTerminated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := newDB(t)
	seed(t, pool, 0, 1000, 3, 1)
	blocker, blockerPID := blockFirstRow(t, pool)
	s := spec(func(s *batch.Spec) { s.Chunk.LockTimeout = batch.Duration(time.Minute) })
	done := startRun(t, url, s, batch.Config{LeaseTTL: testLease})

	var chunkPID int32
	waitFor(t, time.Minute, "the first chunk waiting on the blocked key", func() bool {
		err := pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> $1`, blockerPID).Scan(&chunkPID)
		return err == nil
	})
	var ok bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, chunkPID).Scan(&ok))
	require.True(t, ok)
	waitFor(t, time.Minute, "the chunk retried on a new connection", func() bool {
		return queryInt(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid NOT IN ($1, $2)`, blockerPID, chunkPID) == 1
	})
	require.NoError(t, blocker.Rollback(ctx))

	res := <-done
	require.NoError(t, res.err)
	require.True(t, res.sum.Done)
	exact(t, url, s.Job, 1000)
}

// stopImmediately stops a private PostgreSQL the way a crash does
// (pg_ctl stop -m immediate: no shutdown checkpoint, clients cut off).
func stopImmediately(t *testing.T, srv *stack.Server) {
	t.Helper()
	bins, err := filepath.Glob("/usr/lib/postgresql/*/bin/pg_ctl")
	require.NoError(t, err)
	require.NotEmpty(t, bins)
	args := []string{bins[len(bins)-1], "-D", filepath.Join(srv.Dir, "postgres", "data"), "-m", "immediate", "-w", "stop"}
	cmd := exec.Command(args[0], args[1:]...)
	if u, _ := exec.Command("id", "-u").Output(); string(u) == "0\n" {
		cmd = exec.Command("runuser", append([]string{"-u", "postgres", "--"}, args...)...)
	}
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
}

// A PostgreSQL restart in the middle of a run: every connection is cut.
// The chunks in flight rolled back; the run retries them on new
// connections once the server is back and ends with the exact result, on
// its own.
func TestRunSurvivesAPostgresRestart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := stack.Private(t, "postgres")
	url := srv.Env
	pool := stack.Pool(t, url)
	// The test cluster acknowledges commits before their WAL is written
	// (synchronous_commit = off), so a crash may lose the last ones; this
	// test needs a server that keeps what it acknowledged, as production
	// does.
	_, err := pool.Exec(ctx, `ALTER SYSTEM SET synchronous_commit = on`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `SELECT pg_reload_conf()`)
	require.NoError(t, err)
	_, err = migrate.Up(ctx, pool, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	_, err = pool.Exec(ctx, batch.DemoSchemaSQL)
	require.NoError(t, err)
	seed(t, pool, 0, 20_000, 3, 1)
	s := spec(func(s *batch.Spec) {
		s.Chunk = batch.ChunkSettings{Size: 200, Min: 200, Max: 200}
		s.Errors = batch.ErrorPolicy{MaxRetries: 30, InitialBackoff: batch.Duration(100 * time.Millisecond), MaxBackoff: batch.Duration(time.Second)}
	})
	done := startRun(t, url, s, batch.Config{LeaseTTL: 10 * time.Second})

	waitFor(t, time.Minute, "some chunks committed", func() bool {
		return queryInt(t, pool, `SELECT COALESCE(sum(processed_count), 0) FROM batch_runs`) >= 2000
	})
	stopImmediately(t, srv)
	require.NoError(t, srv.Start())

	res := <-done
	require.NoError(t, res.err)
	require.True(t, res.sum.Done)
	exact(t, url, s.Job, 20_000)
}
