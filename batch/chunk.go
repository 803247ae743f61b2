package batch

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/internal/tracing"
)

// The chunk executor: one chunk is one transaction on its own connection
// (results, outbox events and checkpoint commit together or not at all),
// retried on transient errors, pipelined behind the chunk before it.

// flight is one chunk in flight on its own connection.
type flight struct {
	slot *connSlot // its connection; only the chunk's goroutine uses it while in flight
	// pid is the backend of its current attempt, for the chunk after it.
	pid  atomic.Uint32
	prev []string // the cursor the chunk starts after (its checkpoint's condition)
	upto []string // pipelined: the chunk's last key, found before it ran; nil: LIMIT size
	size int
	// limit is the LIMIT of a planned range's read (0: twice size), raised
	// after a read filled it.
	limit int
	// pred is the chunk before this one when it was in flight at launch:
	// this one's checkpoint waits for it and matches only if it committed.
	pred   *flight
	begun  atomic.Bool   // an attempt has begun its transaction
	locked chan struct{} // closed once an attempt's checkpoint UPDATE returned (holding the row lock)
	lockMu sync.Once
	done   chan struct{}
	res    chunkResult
	err    error
}

func (f *flight) checkpointed() { f.lockMu.Do(func() { close(f.locked) }) }

// errRangeGrew: so many rows were inserted inside a planned chunk's range
// since it was planned that its read filled the LIMIT; the chunk rolls back
// and reads again with a larger one.
var errRangeGrew = errors.New("the planned chunk's range grew past its read limit")

// errPredecessor: the chunk before this one did not commit (it failed or
// rolled back for a retry), so this chunk's checkpoint matched no row.
var errPredecessor = errors.New("the previous chunk did not commit")

// errYield: a pipelined chunk rolled back because the chunk before it waited
// for a lock it held (an id in both chunks: the source's id column is not
// unique). The server cannot see that deadlock, since this chunk waits for
// the previous one in Go; the partition starts again from the checkpoint
// once the previous chunk is over.
var errYield = errors.New("the previous chunk waits for a row this chunk wrote")

// planChunk reads where the chunk after cursor ends: its row count (at most
// size) and its last key. Transient errors (a lost connection among them)
// are retried like a chunk's.
func (r *Runner) planChunk(ctx context.Context, slot *connSlot, cl *claim, cursor []string, size int) (int, []string, error) {
	st := r.c.keysNext
	if cursor == nil {
		st = r.c.keysFirst
	}
	a := &args{Cursor: cursor, Boundary: cl.boundary, Limit: size, PKey: cl.key}
	var (
		n   int
		end []string
	)
	op := func() error {
		conn, err := slot.ensure(ctx)
		if err == nil {
			err = conn.QueryRow(ctx, st.sql, st.bind(a)...).Scan(&n, &end)
		}
		if err != nil && (ctx.Err() != nil || !(IsRetryable(err) || slot.lost())) {
			return backoff.Permanent(err)
		}
		return err
	}
	notify := func(err error, d time.Duration) {
		r.cfg.Logger.Warn("finding the end of the next chunk failed; retrying", append(r.logAttrs(cl.key), slog.String("error", err.Error()), slog.Duration("backoff", d))...)
	}
	if err := backoff.RetryNotify(op, r.retryBackoff(ctx), notify); err != nil {
		return 0, nil, fmt.Errorf("find the end of the chunk after %v: %w", cursor, err)
	}
	return n, end, nil
}

// retryBackoff is the bounded, jittered backoff of the spec's errors
// settings.
func (r *Runner) retryBackoff(ctx context.Context) backoff.BackOff {
	return backoff.WithContext(r.retryAttempts(), ctx)
}

// retryAttempts is the spec's retry schedule: exponential with jitter,
// bounded by attempts.
func (r *Runner) retryAttempts() backoff.BackOff {
	expo := backoff.NewExponentialBackOff()
	expo.InitialInterval = time.Duration(r.spec.Errors.InitialBackoff)
	expo.MaxInterval = time.Duration(r.spec.Errors.MaxBackoff)
	expo.RandomizationFactor = 0.5 // jitter
	expo.MaxElapsedTime = 0        // bounded by attempts instead
	return backoff.WithMaxRetries(expo, uint64(r.spec.Errors.MaxRetries))
}

// connSlot is the pooled connection a worker keeps for one chunk in flight.
// A connection the server ended (a terminated backend, a restart) is
// replaced by a new one before its next use, so a retry does not run on a
// dead connection.
type connSlot struct {
	pool *pgxpool.Pool
	pc   *pgxpool.Conn
}

// lost reports whether the slot's connection is closed.
func (s *connSlot) lost() bool { return s.pc == nil || s.pc.Conn().IsClosed() }

// ensure returns a live connection, acquiring a new one for a closed one.
func (s *connSlot) ensure(ctx context.Context) (*pgx.Conn, error) {
	if !s.lost() {
		return s.pc.Conn(), nil
	}
	s.release()
	pc, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("reconnect: %w", err)
	}
	s.pc = pc
	return pc.Conn(), nil
}

func (s *connSlot) release() {
	if s.pc != nil {
		s.pc.Release() // the pool drops a closed connection
		s.pc = nil
	}
}

// reserveChunk takes one of MaxChunks for a chunk about to start, so chunks
// in flight never commit more than MaxChunks in all.
func (r *Runner) reserveChunk() bool {
	if r.cfg.MaxChunks == 0 {
		return true
	}
	if r.reserved.Add(1) > int64(r.cfg.MaxChunks) {
		r.reserved.Add(-1)
		return false
	}
	return true
}

func (r *Runner) unreserveChunk() {
	if r.cfg.MaxChunks > 0 {
		r.reserved.Add(-1)
	}
}

type chunkResult struct {
	retries     int64
	committing  bool // the attempt reached its COMMIT
	n, size     int
	bad         int64
	changed     int64
	next        []string
	fetch, proc time.Duration // SQL path: the whole chunk statement / 0; Go path: the read / the processor
	write       time.Duration // Go path: the unnest upsert + outbox statement
	commit      time.Duration // (Go path: write +) checkpoint UPDATE + COMMIT
}

// errNotFresh: a first load's chunk, written with plain INSERTs, met a row
// of normalized_records or an event that was there already (an id the
// source holds twice, another writer of the source name, an application's
// event with the same id) and rolled back. It is not retried on its own:
// the partition lets the chunks in flight behind it roll back too (one may
// hold a row the guarded retry would wait for), then starts again from the
// last checkpoint with the guarded upsert, which updates or skips them,
// for the rest of the partition. No retry budget, backoff or size cut.
var errNotFresh = errors.New("a row or event of this first load's chunk is there already; writing it again with the guarded upsert")

// notFresh turns a unique violation of a chunk written with plain INSERTs
// into errNotFresh, and makes the claim's later chunks write the guarded
// way.
func notFresh(cl *claim, fresh bool, err error) error {
	if !fresh || !isUniqueViolation(err) {
		return err
	}
	cl.fresh.Store(false)
	return fmt.Errorf("%w: %w", errNotFresh, err)
}

// chunkWithRetry runs a chunk, retrying transient errors. It does not
// touch the partition's bookkeeping: chunks in flight finish in any order,
// the caller takes their results in cursor order.
func (r *Runner) chunkWithRetry(ctx context.Context, f *flight, cl *claim, sizer *Sizer, log *slog.Logger) (chunkResult, error) {
	ra := &retryAfterBackOff{inner: r.retryAttempts()}
	bo := backoff.WithContext(ra, ctx)
	var (
		res     chunkResult
		retries int64
		unsure  *chunkResult // an attempt whose COMMIT lost its connection: it may have committed
	)
	op := func() error {
		start := time.Now()
		if unsure != nil {
			committed, err := r.committed(ctx, f, cl)
			if err != nil {
				return err // still unreachable: retried
			}
			if committed {
				res = *unsure
				return nil
			}
			unsure = nil
		}
		var err error
		size := f.size
		if f.upto == nil {
			size = sizer.Size() // cut by a retry; a planned range keeps its size
		}
		pctx := withProcEnv(ctx, &procEnv{
			info:    ChunkInfo{Job: r.spec.Job, RunID: r.runID, Partition: cl.key, Attempt: cl.attempt, Retry: retries},
			limiter: r.limiter, metrics: r.cfg.Metrics,
		})
		res, err = r.chunk(pctx, f, cl, size, retries)
		if err == nil {
			return nil
		}
		lost := f.slot.lost() && !isIdleTimeout(err)
		if lost && res.committing {
			u := res
			unsure = &u
		}
		if d, ok := retryAfter(err); ok && ctx.Err() == nil {
			// The service asked for a pause: every call of this process
			// waits for it, and the retry comes no sooner.
			r.limiter.pause(d)
			ra.next = d
			return err
		}
		if isIdleTimeout(err) {
			err = fmt.Errorf("%w (%s, idle_in_transaction_session_timeout): this worker sent no statement for that long "+
				"(it was stopped or starved, or a custom Processor worked that long on one slice of rows); "+
				"raise the lease TTL or make the processor faster; the chunk rolled back: %w", ErrIdleTimeout, r.cfg.LeaseTTL, err)
		}
		if isLockTimeout(err) && r.cfg.Metrics != nil {
			r.cfg.Metrics.LockWait.WithLabelValues(r.spec.Job).Observe(time.Since(start).Seconds())
		}
		// A lost connection rolled the chunk back (unless its COMMIT got
		// through, which the next attempt checks first): retried on a new
		// connection.
		if ctx.Err() != nil || errors.Is(err, errNotFresh) || !(IsRetryable(err) || lost || errors.Is(err, errRangeGrew)) {
			return backoff.Permanent(err)
		}
		return err
	}
	notify := func(err error, d time.Duration) {
		retries++
		reason := reasonTransient
		if isLockTimeout(err) {
			reason = reasonLockTimeout
		} else if _, ok := retryAfter(err); ok {
			reason = reasonRetryAfter
		}
		// A lock wait or an error is a strong signal: cut the size at once.
		sizer.Backoff()
		if r.cfg.Metrics != nil {
			r.cfg.Metrics.Retries.WithLabelValues(r.spec.Job, reason).Inc()
		}
		log.Warn("chunk rolled back; retrying", slog.String("reason", reason), slog.String("error", err.Error()),
			slog.Int64("attempt", retries), slog.Duration("backoff", d), slog.Int("chunk_size", sizer.Size()))
	}
	if err := backoff.RetryNotify(op, bo, notify); err != nil {
		return res, err
	}
	res.retries = retries
	return res, nil
}

func (r *Runner) observe(cl *claim, res chunkResult, log *slog.Logger, nextSize int) {
	r.rows.Add(int64(res.n))
	r.changed.Add(res.changed)
	r.bad.Add(res.bad)
	cl.processed += int64(res.n)
	if m := r.cfg.Metrics; m != nil {
		job := r.spec.Job
		m.ChunkDuration.WithLabelValues(job, "fetch").Observe(res.fetch.Seconds())
		m.ChunkDuration.WithLabelValues(job, "process").Observe(res.proc.Seconds())
		m.ChunkDuration.WithLabelValues(job, "commit").Observe(res.commit.Seconds())
		m.ChunkDuration.WithLabelValues(job, "total").Observe((res.fetch + res.proc + res.commit).Seconds())
		m.ChunkSize.WithLabelValues(job).Set(float64(nextSize))
		m.Rows.WithLabelValues(job, "changed").Add(float64(res.changed))
		m.Rows.WithLabelValues(job, "unchanged").Add(float64(int64(res.n) - res.changed - res.bad))
		m.Rows.WithLabelValues(job, "quarantined").Add(float64(res.bad))
	}
	level := slog.LevelInfo
	if r.progress != nil {
		level = slog.LevelDebug
		r.progress.add(int64(res.n))
	}
	log.Log(context.Background(), level, "chunk committed",
		slog.Int("rows", res.n), slog.Int64("changed", res.changed), slog.Int64("quarantined", res.bad),
		slog.Int("chunk_size", res.size), slog.Int("next_chunk_size", nextSize),
		slog.Any("cursor_to", res.next), slog.Int64("processed", cl.processed),
		slog.Float64("fetch_ms", ms(res.fetch)), slog.Float64("process_ms", ms(res.proc)), slog.Float64("commit_ms", ms(res.commit)),
		slog.Int64("rss_bytes", RSS()))
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// chunk is one transaction: results, outbox events and checkpoint commit
// together or not at all.
func (r *Runner) chunk(ctx context.Context, f *flight, cl *claim, size int, retries int64) (chunkResult, error) {
	cursor := f.prev
	res := chunkResult{size: size}
	ctx, span := tracing.Start(ctx, "batch.chunk")
	defer span.End()
	conn, err := f.slot.ensure(ctx)
	if err != nil {
		return res, err
	}
	f.pid.Store(conn.PgConn().PID())
	hit("batch.before_tx")
	t0 := time.Now()
	tx, err := conn.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("begin chunk: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	f.begun.Store(true)
	// work_mem: a chunk materializes its rows and documents once; spilling
	// them to temp files would cost more than the memory.
	// idle_in_transaction_session_timeout: a worker frozen inside a
	// transaction (SIGSTOP, a GC pause of the VM) must not keep its locks
	// past its lease, so the server ends the session. A live worker's
	// transaction is idle only between statements, while a custom Processor
	// works, and while a pipelined chunk waits for the one before it, which
	// reads the lease meanwhile (awaitPredecessor). Transaction-local: the
	// connections go back to the caller's pool.
	if _, err := tx.Exec(ctx, chunkSettingsSQL,
		strconv.FormatInt(time.Duration(r.spec.Chunk.LockTimeout).Milliseconds(), 10), strconv.FormatInt(r.cfg.LeaseTTL.Milliseconds(), 10)); err != nil {
		return res, fmt.Errorf("begin chunk: %w", err)
	}
	if len(r.c.rels) > 0 {
		if _, err := tx.Exec(ctx, relLockSharedSQL, r.spec.Job); err != nil {
			return res, fmt.Errorf("begin chunk: %w", err)
		}
	}
	a := &args{
		Cursor: cursor, Boundary: cl.boundary, Limit: size, PKey: cl.key,
		Job: r.spec.Job, Run: r.runID, Source: r.spec.SourceName, PV: r.spec.ProcessorVersion,
		TP: tracing.Arg(ctx),
	}
	limit := 0
	if f.upto != nil {
		// The planned range (cursor, upto], read whole: rows inserted inside
		// it since it was planned (text or random keys, a created_at from a
		// long transaction) must not push the rows that were there out of
		// the read, since the checkpoint moves to upto. The LIMIT stays (it
		// makes the planner walk the cursor index) with room for such rows;
		// a read that fills it is retried with a larger one (errRangeGrew).
		limit = cmp.Or(f.limit, 2*f.size)
		a.Boundary, a.Limit = f.upto, limit
	}
	fresh := cl.fresh.Load()
	if r.cfg.Processor == nil {
		st := r.c.chunkNext
		switch {
		case cursor == nil && fresh:
			st = r.c.chunkFirstFresh
		case cursor == nil:
			st = r.c.chunkFirst
		case fresh:
			st = r.c.chunkNextFresh
		}
		var firstBad *string
		if err := tx.QueryRow(ctx, st.sql, st.bind(a)...).Scan(&res.n, &res.bad, &firstBad, &res.changed, &res.next); err != nil {
			return res, notFresh(cl, fresh, fmt.Errorf("select and upsert chunk after %v: %w", cursor, err))
		}
		if res.bad > 0 && r.spec.Errors.Policy != PolicyQuarantine {
			return res, parseBadRow(*firstBad)
		}
		res.fetch = time.Since(t0)
		r.cfg.Metrics.inflight(r.spec.Job, res.n)
		defer r.cfg.Metrics.inflight(r.spec.Job, -res.n)
	} else {
		if _, err := r.goChunk(ctx, tx, a, &res, fresh); err != nil {
			return res, notFresh(cl, fresh, err)
		}
	}
	if f.upto != nil {
		if res.n >= limit {
			f.limit = 4 * limit
			return res, fmt.Errorf("%w: %d rows or more between %v and %v, planned %d", errRangeGrew, limit, cursor, f.upto, f.size)
		}
		// The cursor is the planned last key: a real row when it was read,
		// and where the next chunk in flight starts.
		res.next = f.upto
	} else if res.n == 0 {
		return res, nil // the range is done; nothing to commit
	}
	hit("batch.after_upsert")
	// Tests make PostgreSQL fail the chunk here, after it wrote its rows,
	// with an error the retry policy handles (nothing in release builds).
	if err := injectedFailure(ctx, tx, "batch.chunk_error"); err != nil {
		return res, fmt.Errorf("after the upsert: %w", err)
	}
	t1 := time.Now()
	// The events were inserted by the upsert's statement (a CTE step over
	// the rows it RETURNed); no document crosses the wire twice.
	hit("batch.after_outbox")
	a.Next, a.Prev, a.Token = res.next, cursor, cl.token
	a.N, a.Changed, a.Bad, a.Size, a.Retries = int64(res.n), res.changed, res.bad, size, retries
	if f.pred != nil {
		// Wait until the previous chunk holds the checkpoint row (or is
		// over), then lock the row: that waits until the previous chunk
		// commits or rolls back, and the UPDATE below (a new snapshot) sees
		// its cursor. Without the lock the UPDATE would test its condition
		// on the old row version, find no match and never wait. The wait
		// is ordering, not contention, and the previous chunk's own lock
		// timeout bounds it.
		if err := r.awaitPredecessor(ctx, tx, f, cl); err != nil {
			return res, err
		}
		b := &pgx.Batch{}
		b.Queue(noLockTimeoutSQL)
		b.Queue(lockCheckpointSQL, r.spec.Job, r.runID, cl.key)
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return res, fmt.Errorf("wait for the previous chunk: %w", err)
		}
	}
	// After the previous chunk in flight committed (or rolled back): the
	// run's totals then include it.
	if err := r.checkSkipLimit(ctx, tx, res); err != nil {
		return res, err
	}
	tag, err := tx.Exec(ctx, r.c.checkpoint.sql, r.c.checkpoint.bind(a)...)
	f.checkpointed()
	if err != nil {
		return res, fmt.Errorf("write checkpoint: %w", err)
	}
	if tag.RowsAffected() != 1 {
		// Zero rows: lost ownership (or paused, or an invariant, or the
		// previous chunk in flight did not commit). Roll back.
		why := cl.check(ctx)
		if f.pred != nil && errors.Is(why, ErrCheckpointInvariant) {
			return res, errPredecessor
		}
		return res, why
	}
	hit("batch.after_checkpoint")
	res.committing = true
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("commit chunk: %w", err)
	}
	hit("batch.after_commit")
	res.commit = time.Since(t1) + res.write
	return res, nil
}

// committed reads, after a COMMIT whose connection was lost, whether the
// chunk's checkpoint (from f.prev to its end) got through under this
// lease. The cursor need not be the chunk's end: its successor (pipelined,
// waiting on the checkpoint row) may have committed since, and its
// checkpoint UPDATE matches only the chunk's end, so only after this
// chunk committed. The chunk the COMMIT was sent for had moved the cursor
// from f.prev (its predecessor had committed); while this lease holds the
// partition nothing else moves it. So the COMMIT got through unless the
// cursor is still f.prev.
func (r *Runner) committed(ctx context.Context, f *flight, cl *claim) (bool, error) {
	conn, err := f.slot.ensure(ctx)
	if err != nil {
		return false, err
	}
	cursor, held, err := cl.checkpoint(ctx, conn)
	if err != nil {
		return false, fmt.Errorf("read the checkpoint after a lost COMMIT: %w", err)
	}
	// Not held: not ours any more, the attempt finds out why.
	return held && !slices.Equal(cursor, f.prev), nil
}

// awaitPredecessor waits until the chunk before f holds the checkpoint row
// or is over. f's transaction sits idle on the server meanwhile, and the
// server ends a transaction idle for the lease TTL (see chunk): that is for
// a frozen worker, not for one whose previous chunk takes longer than the
// lease. So every third of the lease TTL the wait reads the lease on tx:
// the statement restarts the server's idle timer, and a lease another
// worker took ends the wait at once (the chunk rolls back and releases its
// row locks). A frozen worker sends nothing, and its session still ends a
// lease TTL after its last statement.
//
// The same statement checks that the previous chunk's backend is still in
// a transaction (running, waiting on a lock, or between statements). When
// it is not, the previous chunk is stuck in Go (a Processor that ignores
// ctx; the server ended its idle session) or between two attempts: the wait
// ends at once with errPredecessor, rather than hold this chunk's row locks
// and snapshot for as long as the previous chunk's goroutine hangs. The
// partition takes that as it takes a checkpoint that did not match: after
// a retried predecessor it runs the chunk again, otherwise the
// predecessor's own error fails the partition.
func (r *Runner) awaitPredecessor(ctx context.Context, tx pgx.Tx, f *flight, cl *claim) error {
	// Often enough to see the previous chunk blocked on this one's rows
	// long before its lock timeout.
	tick := time.NewTicker(min(r.cfg.LeaseTTL/3, time.Second))
	defer tick.Stop()
	for {
		select {
		case <-f.pred.locked:
			return nil
		case <-f.pred.done:
			return nil
		case <-ctx.Done():
			return fmt.Errorf("wait for the previous chunk: %w", context.Cause(ctx))
		case <-tick.C:
		}
		pid := f.pred.pid.Load() // its attempt's backend (a retry may have reconnected)
		held, busy, blocked, err := cl.waitCheck(ctx, tx, pid)
		if err != nil {
			return fmt.Errorf("check the lease while waiting for the previous chunk: %w", err)
		}
		if !held {
			return cl.check(ctx)
		}
		select {
		case <-f.pred.locked: // it reached its checkpoint meanwhile (then committed, or is committing)
			return nil
		case <-f.pred.done:
			return nil
		default:
		}
		if blocked {
			r.cfg.Logger.Info("the previous chunk waits for a row this chunk wrote (an id in both); rolling this chunk back",
				append(r.logAttrs(cl.key), slog.Int64("previous_pid", int64(pid)))...)
			return fmt.Errorf("wait for the previous chunk (pid %d): %w", pid, errYield)
		}
		if !busy && f.pred.begun.Load() {
			r.cfg.Logger.Warn("the previous chunk's session is not in a transaction while this chunk waits for it; rolling this chunk back",
				append(r.logAttrs(cl.key), slog.Int64("previous_pid", int64(pid)))...)
			return fmt.Errorf("wait for the previous chunk: its session (pid %d) is not in a transaction: %w", pid, errPredecessor)
		}
	}
}

func parseBadRow(s string) error {
	id, rest, _ := strings.Cut(s, ": ")
	code, msg, _ := strings.Cut(rest, ": ")
	return &BadRowError{ID: id, Code: code, Message: msg}
}

// RSS returns the resident set size of this process in bytes (0 if
// unknown), for the per-chunk log line.
func RSS() int64 { return procStatus("VmRSS:") }

// PeakRSS returns the peak resident set size (VmHWM) in bytes.
func PeakRSS() int64 { return procStatus("VmHWM:") }

func procStatus(field string) int64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), field); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return kb * 1024
		}
	}
	return 0
}
