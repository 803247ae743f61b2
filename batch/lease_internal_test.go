package batch

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// These tests call awaitPredecessor directly: the waiting chunk's heartbeat
// would also notice a lost lease and cancel a whole run, so only a direct
// call shows what the wait itself does.

// internalLease is long enough that a scheduling stall of over a second
// under -race on a loaded CI machine does not let the server end a session
// that the wait keeps refreshing (every third of it).
const internalLease = 2 * time.Second

// waitSetup is a prepared run with a claimed partition, as a worker has it
// while a pipelined chunk waits for the chunk before it.
type waitSetup struct {
	r    *Runner
	cl   *claim
	url  string
	pool *pgxpool.Pool
}

func newWaitSetup(t *testing.T) waitSetup {
	t.Helper()
	ctx := context.Background()
	url := stack.Database(t)
	pool := stack.Pool(t, url)
	_, err := pool.Exec(ctx, DemoSchemaSQL)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO source_records (id, created_at, tenant_id, payload) SELECT g, now(), 't0', '{}' FROM generate_series(1, 10) g`)
	require.NoError(t, err)
	r, err := NewRunner(pool, DemoSpec(), Config{LeaseTTL: internalLease})
	require.NoError(t, err)
	_, err = r.Prepare(ctx)
	require.NoError(t, err)
	cl, err := claimPartition(ctx, pool, r.spec.Job, r.runID, nil, "test", internalLease)
	require.NoError(t, err)
	require.NotNil(t, cl)
	return waitSetup{r: r, cl: cl, url: url, pool: pool}
}

// connect opens a connection of its own (not from the pool: the server may
// end its session).
func connect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// beginIdleBounded begins a transaction that the server ends once it sits
// idle for the lease TTL, as a chunk's transaction does.
func beginIdleBounded(t *testing.T, conn *pgx.Conn) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT set_config('idle_in_transaction_session_timeout', $1, true)`, strconv.FormatInt(internalLease.Milliseconds(), 10))
	require.NoError(t, err)
	return tx
}

// startWait runs awaitPredecessor for a chunk on conn/tx waiting for pred,
// bounded by a few lease TTLs, and returns its result.
func startWait(t *testing.T, s waitSetup, conn *pgx.Conn, tx pgx.Tx, pred *flight) <-chan error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*internalLease)
	f := &flight{pred: pred, locked: make(chan struct{}), done: make(chan struct{})}
	res := make(chan error, 1)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		res <- s.r.awaitPredecessor(ctx, tx, f, s.cl)
	}()
	t.Cleanup(func() { cancel(); <-finished })
	return res
}

// pollUntil polls a server-side condition until it holds, failing the test
// after timeout or if the wait ended first.
func pollUntil(t *testing.T, timeout time.Duration, what string, waitRes <-chan error, cond func() bool) {
	t.Helper()
	deadline := time.After(timeout)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case err := <-waitRes:
			t.Fatalf("the wait ended before %s: %v", what, err)
		case <-deadline:
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		case <-tick.C:
		}
	}
}

// A chunk waiting for its predecessor (here one that stays in its
// transaction and never finishes) stops at once when another worker takes
// the lease, with ErrLeaseLost, even though nothing else (no heartbeat)
// tells it; until then its reads keep its idle transaction alive past the
// lease TTL.
func TestAwaitPredecessorStopsWhenTheLeaseIsTaken(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := newWaitSetup(t)

	predConn := connect(t, s.url)
	predTx, err := predConn.Begin(ctx) // in a transaction, no idle timeout: a slow, live predecessor
	require.NoError(t, err)
	_, err = predTx.Exec(ctx, `SELECT 1`)
	require.NoError(t, err)
	pred := &flight{locked: make(chan struct{}), done: make(chan struct{})}
	pred.pid.Store(predConn.PgConn().PID())
	pred.begun.Store(true)

	conn := connect(t, s.url)
	tx := beginIdleBounded(t, conn)
	waitRes := startWait(t, s, conn, tx, pred)

	pid := conn.PgConn().PID()
	pollUntil(t, 4*internalLease, "the waiting transaction to be open for over a lease TTL", waitRes, func() bool {
		var alive bool
		require.NoError(t, s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1 AND state = 'idle in transaction' AND xact_start < now() - $2::interval)`,
			int64(pid), internalLease.String()).Scan(&alive))
		return alive
	})
	_, err = s.pool.Exec(ctx, `UPDATE batch_runs SET lease_token = gen_random_uuid(), lease_owner = 'another worker' WHERE job = $1`, s.r.spec.Job)
	require.NoError(t, err)

	select {
	case err := <-waitRes:
		require.ErrorIs(t, err, ErrLeaseLost)
	case <-time.After(internalLease): // a read every third of the lease
		t.Fatal("the wait went on after another worker took the lease")
	}
}

// A chunk waiting for a predecessor whose goroutine hangs (a Processor that
// ignores its context) must not keep its transaction open for as long: once
// the server has ended the predecessor's idle session, the wait ends with
// errPredecessor, its own session still alive (it was not left to the
// server's timeout).
func TestAwaitPredecessorGivesUpOnAStuckPredecessor(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := newWaitSetup(t)

	predConn := connect(t, s.url)
	beginIdleBounded(t, predConn) // sends nothing more: the server ends it a lease TTL later
	predPID := predConn.PgConn().PID()
	pred := &flight{locked: make(chan struct{}), done: make(chan struct{})}
	pred.pid.Store(predConn.PgConn().PID())
	pred.begun.Store(true)

	conn := connect(t, s.url)
	tx := beginIdleBounded(t, conn)
	start := time.Now()
	waitRes := startWait(t, s, conn, tx, pred)

	var err error
	select {
	case err = <-waitRes:
	case <-time.After(4 * internalLease):
		t.Fatal("the wait went on after the predecessor's session ended")
	}
	require.ErrorIs(t, err, errPredecessor)
	require.GreaterOrEqual(t, time.Since(start), internalLease, "the predecessor was in its transaction for a lease TTL")
	var predGone bool
	require.NoError(t, s.pool.QueryRow(ctx, `SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)`, int64(predPID)).Scan(&predGone))
	require.True(t, predGone, "the server ended the predecessor's session")
	_, err = tx.Exec(ctx, `SELECT 1`)
	require.NoError(t, err, "the waiting chunk's own session is alive: the wait ended it, not the server")
}
