package batch

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// A lease is a worker's claim on a partition of a run (or on a run's
// sweep): a row of batch_runs (batch_sweeps) with a random token, renewed
// by a heartbeat. Every write of the holder is conditioned on the token
// (the fence), and zero affected rows means the lease is lost: stop, do
// not report success.

// lease is a claimed partition: (job, run, key, token), with the
// statements fenced by its token.
type lease struct {
	db                   querier
	job, run, key, token string
	ttl                  time.Duration
}

// claim is a partition this worker leased, and where it stands.
type claim struct {
	*lease
	cursor    []string
	boundary  []string
	chunkSize int
	processed int64
	estimate  *int64
	attempt   int
	// fresh: the run is a first load (batch_runs.first_load) and no chunk
	// of the partition has met a row or event that was there already, so
	// chunks write with plain INSERTs (compiled.chunkNextFresh). Shared by
	// the claim's chunks in flight.
	fresh atomic.Bool
}

// claimPartition leases the first partition of the run (or the one named
// by partition) that is pending and due, or running under a stale lease. It
// returns nil when there is none.
func claimPartition(ctx context.Context, db querier, job, run string, partition *string, owner string, ttl time.Duration) (*claim, error) {
	c := claim{lease: &lease{db: db, job: job, run: run, ttl: ttl}}
	var firstLoad bool
	err := db.QueryRow(ctx, claimSQL, job, run, partition, owner, ttl.String()).Scan(&c.key, &c.token, &c.cursor, &c.boundary, &c.chunkSize, &c.processed, &c.estimate, &c.attempt, &firstLoad)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("claim a partition of %s/%s: %w", job, run, err)
	}
	c.fresh.Store(firstLoad)
	return &c, nil
}

// unfinished counts partitions some worker may still work on.
func unfinished(ctx context.Context, db querier, job, run string, partition *string) (int, error) {
	var n int
	err := db.QueryRow(ctx, unfinishedSQL, job, run, partition).Scan(&n)
	return n, err
}

// renew extends the lease by its TTL; false: it is not held any more.
func (l *lease) renew(ctx context.Context) (bool, error) {
	tag, err := l.db.Exec(ctx, heartbeatSQL, l.job, l.run, l.key, l.token, l.ttl.String())
	return tag.RowsAffected() == 1, err
}

// check explains a fenced write that touched no row: [errPaused], an
// [ErrLeaseLost], or an [ErrCheckpointInvariant] when the lease is still
// held.
func (l *lease) check(ctx context.Context) error {
	var state string
	var tok *string
	err := l.db.QueryRow(ctx, leaseStateSQL, l.job, l.run, l.key).Scan(&state, &tok)
	switch {
	case err != nil:
		return fmt.Errorf("%w: %s/%s/%s: %v", ErrLeaseLost, l.job, l.run, l.key, err)
	case state == "paused":
		return errPaused
	case tok == nil || *tok != l.token || state != "running":
		return fmt.Errorf("%w: %s/%s/%s is %s now", ErrLeaseLost, l.job, l.run, l.key, state)
	default:
		return fmt.Errorf("%w: %s/%s/%s: the cursor moved under this worker, or the new cursor is not after the stored one and within the boundary", ErrCheckpointInvariant, l.job, l.run, l.key)
	}
}

// lost is check for the heartbeat: why the lease could not be renewed.
func (l *lease) lost(ctx context.Context) error { return l.check(ctx) }

// release gives the partition back (pending) at its last checkpoint.
func (l *lease) release(ctx context.Context) error {
	_, err := l.db.Exec(ctx, releaseSQL, l.job, l.run, l.key, l.token)
	return err
}

// notFresh records that the partition's chunks write with the guarded
// upsert from now on (errNotFresh), for this claim and any later one.
func (c *claim) notFresh(ctx context.Context) error {
	c.fresh.Store(false)
	_, err := c.db.Exec(ctx, notFreshSQL, c.job, c.run, c.key, c.token)
	return err
}

// finish marks the partition succeeded; false: the lease was not held.
func (l *lease) finish(ctx context.Context) (bool, error) {
	tag, err := l.db.Exec(ctx, finishSQL, l.job, l.run, l.key, l.token)
	return tag.RowsAffected() == 1, err
}

// fail records that the partition failed with cause: back to pending with
// a retry time while attempts (in all) are left, the backoff doubling per
// failure up to maxPartitionBackoff; failed otherwise. It returns when a
// worker may retry it (nil: failed for good) and the failures so far.
func (l *lease) fail(ctx context.Context, cause error, attempts int, backoff time.Duration) (retryAt *time.Time, failures int, err error) {
	var state string
	err = l.db.QueryRow(ctx, failOrRetrySQL, l.job, l.run, l.key, l.token, attempts, cause.Error(),
		backoff.String(), maxPartitionBackoff.String()).Scan(&state, &failures, &retryAt)
	if err != nil {
		return nil, 0, fmt.Errorf("record the failure of %s/%s/%s: %w", l.job, l.run, l.key, err)
	}
	return retryAt, failures, nil
}

// checkpoint reads the partition's cursor under this lease over db (a
// chunk's own connection); ok is false when the lease is not held.
func (l *lease) checkpoint(ctx context.Context, db querier) (cursor []string, ok bool, err error) {
	err = db.QueryRow(ctx, leaseCursorSQL, l.job, l.run, l.key, l.token).Scan(&cursor)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, false, nil
	}
	return cursor, err == nil, err
}

// waitCheck reads, on the transaction of a chunk waiting for the chunk
// before it, whether the lease is still held (by the fence of every write,
// without writing) and whether the previous chunk's backend (pid) is still
// in a transaction: running a statement or waiting on a lock (state
// 'active') or between statements ('idle in transaction'), not 'idle' or
// gone. A state it cannot see (NULL: another role's backend; 'disabled':
// track_activities off) counts as in a transaction, so the wait goes on as
// before. A transaction keeps the first pg_stat_activity it read until it
// ends, so the check clears that snapshot first. blocked: the previous
// chunk waits for a lock the waiting chunk holds (a row both write).
func (l *lease) waitCheck(ctx context.Context, tx pgx.Tx, pid uint32) (held, busy, blocked bool, err error) {
	b := &pgx.Batch{}
	b.Queue(clearStatSnapshotSQL)
	b.Queue(waitCheckSQL, l.job, l.run, l.key, l.token, int64(pid)).QueryRow(func(row pgx.Row) error { return row.Scan(&held, &busy, &blocked) })
	err = tx.SendBatch(ctx, b).Close()
	return held, busy, blocked, err
}

// sweepLease is a claimed sweep of a run: (job, run, token).
type sweepLease struct {
	db              querier
	job, run, token string
	ttl             time.Duration
}

func (l *sweepLease) renew(ctx context.Context) (bool, error) {
	tag, err := l.db.Exec(ctx, heartbeatSweepSQL, l.job, l.run, l.token, l.ttl.String())
	return tag.RowsAffected() == 1, err
}

func (l *sweepLease) lost(context.Context) error {
	return fmt.Errorf("%w: the sweep of %s/%s", ErrLeaseLost, l.job, l.run)
}

func (l *sweepLease) release(ctx context.Context) error {
	_, err := l.db.Exec(ctx, releaseSweepSQL, l.job, l.run, l.token)
	return err
}

func (l *sweepLease) finish(ctx context.Context) (bool, error) {
	tag, err := l.db.Exec(ctx, finishSweepSQL, l.job, l.run, l.token)
	return tag.RowsAffected() == 1, err
}

func (l *sweepLease) fail(ctx context.Context, cause error) error {
	_, err := l.db.Exec(ctx, failSweepSQL, l.job, l.run, l.token, cause.Error())
	return err
}

// renewer is a lease a heartbeat keeps alive.
type renewer interface {
	// renew extends the lease; false: it is not held any more.
	renew(ctx context.Context) (bool, error)
	// lost says why a renewal found the lease gone.
	lost(ctx context.Context) error
}

// keepAlive renews l every interval (each attempt bounded by the
// interval) until ctx ends. A failed renewal is logged and tried again at
// the next tick (the lease lives for its TTL meanwhile); a lease found
// gone cancels ctx with the reason, so the work in flight rolls back. The
// returned stop cancels the heartbeat and waits for it to end.
func keepAlive(ctx context.Context, cancel context.CancelCauseFunc, interval time.Duration, l renewer, log *slog.Logger) (stop func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			hctx, hcancel := context.WithTimeout(ctx, interval)
			ok, err := l.renew(hctx)
			hcancel()
			if err != nil {
				log.Warn("heartbeat failed", slog.String("error", err.Error()))
				continue
			}
			if !ok {
				cancel(l.lost(context.WithoutCancel(ctx)))
				return
			}
		}
	}()
	return func() { cancel(nil); <-done }
}
