package batch

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
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

	"github.com/outboxrelay/outboxrelay/internal/failpoint"
	"github.com/outboxrelay/outboxrelay/internal/tracing"
)

// Config configures a [Runner]. Zero values take the defaults named on
// each field.
type Config struct {
	StartOptions
	// WorkerID names this worker in leases. Default host-pid.
	WorkerID string
	// Workers is how many partitions this process works on at once. Default 1.
	Workers int
	// LeaseTTL is how long a lease lives without a heartbeat before another
	// worker may take the partition. Each chunk transaction also takes it as
	// its idle_in_transaction_session_timeout (transaction-local: the pool's
	// connections keep their own setting), so PostgreSQL ends a frozen
	// worker's session a lease TTL after its last statement: within one
	// heartbeat interval after its lease expires (its last heartbeat may
	// precede its last statement by up to that much).
	//
	// A chunk may take longer than the lease: a pipelined chunk waiting for
	// the one before it reads the lease meanwhile, which keeps its
	// transaction from counting as idle while the one before it is in a
	// transaction on the server. A custom Processor's work does count as
	// idle: with a Processor and an adaptive size, NewRunner requires a
	// lease of at least 3 × chunk.target_duration; with a fixed size
	// (chunk.min = chunk.max) it checks nothing, so the Processor must
	// handle one slice of a chunk (up to 10000 rows) well within the lease.
	// Default 30s.
	LeaseTTL time.Duration
	// HeartbeatInterval between lease renewals. Default LeaseTTL/3.
	HeartbeatInterval time.Duration
	// MaxChunks stops softly after this many committed chunks (all workers
	// of this process together). 0 means no limit.
	MaxChunks int
	// Partition restricts this process to one partition. "" = all.
	Partition string
	// Processor, when set, replaces the built-in SQL normalizer: rows are
	// read into Go, processed and written back with unnest arrays.
	Processor Processor
	// Logger receives a line per chunk (debug level when Progress is set).
	// Default: discard.
	Logger *slog.Logger
	// Metrics, when set, records the batch_* series.
	Metrics *Metrics
	// Progress, when set (a terminal), receives a progress line: processed /
	// estimated, rate, ETA.
	Progress io.Writer
	// RateLimit bounds a custom Processor's external calls: each [Wait]
	// takes a token of a bucket refilled at RateLimit per second, shared by
	// this process's workers (a limit per process: N processes make N
	// times as many calls). 0 means no limit.
	RateLimit float64
	// RateBurst is the bucket's size. Default 1.
	RateBurst int
}

func (c Config) withDefaults() Config {
	if c.WorkerID == "" {
		host, _ := os.Hostname()
		c.WorkerID = cmp.Or(host, "worker") + "-" + strconv.Itoa(os.Getpid())
	}
	c.Workers = cmp.Or(c.Workers, 1)
	c.LeaseTTL = cmp.Or(c.LeaseTTL, 30*time.Second)
	c.HeartbeatInterval = cmp.Or(c.HeartbeatInterval, c.LeaseTTL/3)
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

func (c Config) validate() error {
	switch {
	case c.Workers < 1:
		return fmt.Errorf("workers %d: want >= 1", c.Workers)
	case c.LeaseTTL < 100*time.Millisecond:
		return fmt.Errorf("lease TTL %s: want >= 100ms", c.LeaseTTL)
	case c.HeartbeatInterval >= c.LeaseTTL:
		return fmt.Errorf("heartbeat interval %s must be shorter than the lease TTL %s", c.HeartbeatInterval, c.LeaseTTL)
	case c.MaxChunks < 0:
		return fmt.Errorf("max chunks %d: want >= 0", c.MaxChunks)
	}
	return nil
}

// leaseTargets is how many chunk target durations a lease TTL spans at
// least when a custom Processor runs (see validateFor).
const leaseTargets = 3

// validateFor checks the config against the spec's chunk settings. A custom
// Processor works on a chunk's rows while the chunk's transaction sits idle,
// and the server ends a transaction idle for the lease TTL. The size adapts
// so a chunk lasts about chunk.target_duration, but a step behind when the
// data or the load change: a lease of a few targets leaves room. A fixed
// size (min = max) does not aim at the target, and the built-in SQL
// normalizer runs inside a statement, never idle: nothing to check then.
func (c Config) validateFor(s Spec) error {
	target := time.Duration(s.Chunk.TargetDuration)
	if c.Processor == nil || s.Chunk.Min == s.Chunk.Max || c.LeaseTTL >= leaseTargets*target {
		return nil
	}
	return fmt.Errorf("lease TTL %s is shorter than %d × chunk.target_duration %s of spec %s: a custom Processor works on a chunk "+
		"while the chunk's transaction is idle, and PostgreSQL ends a transaction idle for the lease TTL; "+
		"raise the lease TTL to %s or more, or lower chunk.target_duration to %s or less",
		c.LeaseTTL, leaseTargets, target, s.Job, leaseTargets*target, (c.LeaseTTL / leaseTargets).Truncate(time.Millisecond))
}

// Runner runs one scan job: it prepares the run (boundary, scope,
// compatibility), then its workers claim partitions and process chunks until
// the run is done or they are told to stop.
type Runner struct {
	pool  *pgxpool.Pool
	spec  Spec
	cfg   Config
	c     *compiled
	runID string

	chunks     atomic.Int64
	rows       atomic.Int64
	changed    atomic.Int64
	bad        atomic.Int64
	started    time.Time
	progress   *progress
	maxReached atomic.Bool
	reserved   atomic.Int64 // chunks committed or in flight, against MaxChunks
	limiter    *limiter     // a custom Processor's external calls (Config.RateLimit)
	// ratioSampled: a chunk of this process saw the run reach
	// errors.skip_ratio_min_rows rows within the ratio (checkSkipLimit).
	ratioSampled atomic.Bool
}

// Summary says what a [Runner.Run] did.
type Summary struct {
	RunID       string
	Chunks      int64
	Rows        int64 // source rows committed by this process
	Changed     int64 // rows that produced an event
	Quarantined int64
	// Done is true when every partition of the run has succeeded.
	Done bool
}

// NewRunner checks the spec's defaults and the config. The database checks
// happen in [Runner.Prepare].
func NewRunner(pool *pgxpool.Pool, spec Spec, cfg Config) (*Runner, error) {
	spec = spec.withDefaults()
	if err := spec.validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if err := cfg.validateFor(spec); err != nil {
		return nil, err
	}
	return &Runner{pool: pool, spec: spec, cfg: cfg, limiter: newLimiter(cfg.RateLimit, cfg.RateBurst)}, nil
}

// Prepare checks the spec against the database (table and columns exist),
// then finds, creates or refuses the run (see [StartOptions]). It returns
// the run id. Run calls it when it was not called.
func (r *Runner) Prepare(ctx context.Context) (string, error) {
	if r.runID != "" {
		return r.runID, nil
	}
	c, err := compile(ctx, r.pool, r.spec)
	if err != nil {
		return "", err
	}
	r.c = c
	id, err := prepareRun(ctx, r.pool, c, r.cfg.StartOptions, time.Now())
	if err != nil {
		return "", err
	}
	r.runID = id
	return id, nil
}

var errSoftStop = errors.New("soft stop")

// Run works on the run until every partition is done, soft is cancelled
// (finish the chunk in flight, release the lease, return nil), or hard is
// cancelled (the chunk in flight rolls back). soft must be derived from hard
// or be cancelled no later. A partition whose lease was lost returns
// [ErrLeaseLost]; a failed chunk fails the partition and is returned.
func (r *Runner) Run(soft, hard context.Context) (*Summary, error) {
	// Preparing may wait (for the job lock, for open writers of the source
	// table); a soft stop then ends the wait and nothing was started.
	if _, err := r.Prepare(soft); err != nil {
		if soft.Err() != nil && hard.Err() == nil {
			return &Summary{}, nil
		}
		return nil, err
	}
	r.started = time.Now()
	if r.cfg.Progress != nil {
		r.progress = newProgress(r.cfg.Progress)
		if err := r.progress.load(hard, r.pool, r.spec.Job, r.runID); err != nil {
			return nil, err
		}
	}
	var wg sync.WaitGroup
	errs := make([]error, r.cfg.Workers)
	for i := range r.cfg.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = r.worker(soft, hard, r.cfg.WorkerID+"/"+strconv.Itoa(i))
		}()
	}
	wg.Wait()
	if r.progress != nil {
		r.progress.finish()
	}
	sum := &Summary{RunID: r.runID, Chunks: r.chunks.Load(), Rows: r.rows.Load(), Changed: r.changed.Load(), Quarantined: r.bad.Load()}
	var left int
	if err := r.pool.QueryRow(context.WithoutCancel(hard), runLeftSQL, r.spec.Job, r.runID).Scan(&left); err == nil {
		sum.Done = left == 0
	}
	if err := errors.Join(errs...); err != nil {
		return sum, err
	}
	if hard.Err() != nil {
		return sum, context.Cause(hard)
	}
	if sum.Done && soft.Err() == nil && !r.maxReached.Load() {
		done, err := r.sweep(soft, hard)
		sum.Done = done
		if err != nil {
			return sum, err
		}
	} else if sum.Done {
		sum.Done = false // the sweep is still to come
		if done, err := r.sweepDone(context.WithoutCancel(hard)); err == nil {
			sum.Done = done
		}
	}
	return sum, nil
}

func (r *Runner) partitionFilter() *string {
	if r.cfg.Partition == "" {
		return nil
	}
	return &r.cfg.Partition
}

// worker holds one connection per chunk in flight (its session settings
// live there) and claims partitions until none is left.
func (r *Runner) worker(soft, hard context.Context, id string) error {
	conns := make([]*connSlot, r.inFlight())
	for i := range conns {
		conn, err := r.pool.Acquire(hard)
		if err != nil {
			return fmt.Errorf("acquire a connection: %w", err)
		}
		conns[i] = &connSlot{pool: r.pool, pc: conn}
		defer conns[i].release()
	}
	for {
		if soft.Err() != nil || r.maxReached.Load() {
			return nil
		}
		cl, err := claimPartition(hard, r.pool, r.spec.Job, r.runID, r.partitionFilter(), id, r.cfg.LeaseTTL)
		if err != nil {
			return err
		}
		if cl == nil {
			n, err := unfinished(hard, r.pool, r.spec.Job, r.runID, r.partitionFilter())
			if err != nil {
				return err
			}
			if n == 0 {
				return nil
			}
			// Others hold the rest; wait in case a lease goes stale.
			select {
			case <-soft.Done():
				return nil
			case <-time.After(r.cfg.HeartbeatInterval):
			}
			continue
		}
		err = r.partition(soft, hard, conns, cl, id)
		switch {
		case err == nil, errors.Is(err, errPaused):
			continue
		case errors.Is(err, errSoftStop):
			return nil
		default:
			return err
		}
	}
}

// inFlight is how many chunks of a partition a worker keeps in flight: the
// spec's chunk.pipeline, lowered until every worker's connections plus two
// for heartbeats and lease checks fit in the pool.
func (r *Runner) inFlight() int {
	n := r.spec.Chunk.Pipeline
	for n > 1 && r.cfg.Workers*n+2 > int(r.pool.Config().MaxConns) {
		n--
	}
	return n
}

func (r *Runner) logAttrs(key string) []any {
	return []any{slog.String("job", r.spec.Job), slog.String("run", r.runID), slog.String("partition", key)}
}

// partition processes chunks of one claimed partition.
func (r *Runner) partition(soft, hard context.Context, conns []*connSlot, cl *claim, worker string) error {
	job, run := r.spec.Job, r.runID
	log := r.cfg.Logger.With(r.logAttrs(cl.key)...)
	log.Info("partition claimed", slog.String("worker", worker), slog.Int("attempt", cl.attempt), slog.Any("cursor", cl.cursor), slog.Any("boundary", cl.boundary))
	ctx, cancel := context.WithCancelCause(hard)
	defer cancel(nil)
	// Lost or paused: the heartbeat cancels ctx, the chunk in flight rolls back.
	defer keepAlive(ctx, cancel, r.cfg.HeartbeatInterval, cl.lease, log)()

	size := cmp.Or(cl.chunkSize, r.spec.Chunk.Size)
	sizer := NewSizer(size, r.spec.Chunk.Min, r.spec.Chunk.Max, time.Duration(r.spec.Chunk.TargetDuration))
	cursor := cl.cursor // the last committed checkpoint
	// Lease bookkeeping after a stop must happen even though hard may be
	// cancelled: bounded, detached contexts.
	cctx, ccancel := context.WithTimeout(context.WithoutCancel(hard), time.Hour)
	defer ccancel()
	cleanup := func() context.Context { return cctx }

	// Chunks in flight, oldest first, each on its own connection. With more
	// than one connection the next chunk's range is fixed before it starts
	// (keysFirst/keysNext), so it runs while the previous one commits; its
	// checkpoint UPDATE waits on the previous chunk's row lock and matches
	// only if that chunk committed its end as the cursor.
	pipelined := len(conns) > 1
	free := slices.Clone(conns)
	var (
		queue   []*flight
		next    = cursor             // where the next chunk to launch starts
		more    = cl.boundary != nil // the range may have rows after next
		failure error                // the first failed chunk in cursor order
		replan  bool                 // relaunch from cursor once the queue drains
		retried bool                 // the last committed chunk needed a retry
	)
	for {
		stopping := soft.Err() != nil || r.maxReached.Load()
		for more && !stopping && failure == nil && !replan && len(free) > 0 && (pipelined || len(queue) == 0) {
			if !r.reserveChunk() {
				stopping = true
				break
			}
			conn := free[len(free)-1]
			f := &flight{slot: conn, prev: next, size: sizer.Size(), locked: make(chan struct{}), done: make(chan struct{})}
			if len(queue) > 0 {
				f.pred = queue[len(queue)-1]
			}
			if pipelined {
				n, end, err := r.planChunk(ctx, conn, cl, next, f.size)
				if err != nil || n == 0 {
					r.unreserveChunk()
					failure, more = err, false
					break
				}
				f.upto = end
				next = end
				more = n == f.size
			}
			free = free[:len(free)-1]
			go func() {
				defer close(f.done)
				f.res, f.err = r.chunkWithRetry(ctx, f, cl, sizer, log)
				f.pred = nil // let finished chunks go
			}()
			queue = append(queue, f)
		}
		if len(queue) == 0 {
			if replan && failure == nil {
				replan, next, more = false, cursor, true
				continue
			}
			if failure == nil && more && stopping {
				if err := cl.release(cleanup()); err != nil {
					log.Warn("release lease", slog.String("error", err.Error()))
				}
				log.Info("stopped at the last committed checkpoint", slog.Any("cursor", cursor))
				return errSoftStop
			}
			break
		}
		f := queue[0]
		<-f.done
		queue, free = queue[1:], append(free, f.slot)
		if f.err != nil {
			r.unreserveChunk()
			switch {
			case failure != nil || replan:
				// A chunk after a failed one: it rolled back, as it must.
			case errors.Is(f.err, errPredecessor) && retried:
				// Its checkpoint saw the previous chunk's first attempt roll
				// back; that chunk then committed on a retry. Start again
				// from there.
				replan = true
			default:
				failure = f.err
			}
			continue
		}
		res := f.res
		retried = res.retries > 0
		if res.n > 0 || f.upto != nil {
			sizer.Observe(res.n, res.fetch+res.proc+res.commit)
			r.observe(cl, res, log, sizer.Size())
			cursor = res.next
			n := r.chunks.Add(1)
			if r.cfg.MaxChunks > 0 && n >= int64(r.cfg.MaxChunks) {
				r.maxReached.Store(true)
			}
		} else {
			r.unreserveChunk()
		}
		if !pipelined {
			next = cursor
			more = res.n == res.size
		}
	}
	if err := failure; err != nil {
		if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
			err = cause
		}
		switch {
		case errors.Is(err, errPaused):
			log.Info("partition paused by an operator; chunk rolled back", slog.Any("cursor", cursor))
			return errPaused
		case errors.Is(err, ErrLeaseLost):
			log.Error("lease lost; stopping without writing", slog.String("error", err.Error()))
			return err
		case hard.Err() != nil:
			_ = cl.release(cleanup())
			log.Warn("hard stop: chunk rolled back", slog.Any("cursor", cursor))
			return context.Cause(hard)
		}
		// A chunk that failed because another worker took over (its
		// session was ended while frozen, say) is a lost lease, not a
		// failure of the run.
		if why := cl.check(cleanup()); errors.Is(why, ErrLeaseLost) || errors.Is(why, errPaused) {
			if errors.Is(why, errPaused) {
				return errPaused
			}
			log.Error("lease lost; stopping without writing", slog.String("error", why.Error()), slog.String("chunk_error", err.Error()))
			return why
		}
		attempts := r.spec.Errors.PartitionAttempts
		if permanentFailure(err) {
			attempts = 1 // another attempt would meet the same error
		}
		retryAt, failures, ferr := cl.fail(cleanup(), err, attempts, time.Duration(r.spec.Errors.PartitionBackoff))
		if ferr != nil {
			log.Error("record failure", slog.String("error", ferr.Error()))
		}
		if retryAt != nil {
			log.Warn("partition failed; it will be retried automatically", slog.String("error", err.Error()), slog.Any("cursor", cursor),
				slog.Int("failures", failures), slog.Int("attempts", r.spec.Errors.PartitionAttempts), slog.Time("retry_at", *retryAt))
			return nil
		}
		log.Error("partition failed", slog.String("error", err.Error()), slog.Any("cursor", cursor), slog.Int("failures", failures))
		return fmt.Errorf("job %s run %s partition %q: %w", job, run, cl.key, err)
	}
	ok, err := cl.finish(cleanup())
	if err != nil {
		return fmt.Errorf("finish %s/%s/%s: %w", job, run, cl.key, err)
	}
	if !ok {
		return cl.check(cleanup())
	}
	log.Info("partition succeeded", slog.Any("cursor", cursor))
	return nil
}

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
			committed, err := r.committed(ctx, f, cl, unsure.next)
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
		if ctx.Err() != nil || !(IsRetryable(err) || lost || errors.Is(err, errRangeGrew)) {
			return backoff.Permanent(err)
		}
		return err
	}
	notify := func(err error, d time.Duration) {
		retries++
		reason := "transient"
		if isLockTimeout(err) {
			reason = "lock_timeout"
		} else if _, ok := retryAfter(err); ok {
			reason = "retry_after"
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
	failpoint.Hit("batch.before_tx")
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
	if r.cfg.Processor == nil {
		st := r.c.chunkNext
		if cursor == nil {
			st = r.c.chunkFirst
		}
		var firstBad *string
		if err := tx.QueryRow(ctx, st.sql, st.bind(a)...).Scan(&res.n, &res.bad, &firstBad, &res.changed, &res.next); err != nil {
			return res, fmt.Errorf("select and upsert chunk after %v: %w", cursor, err)
		}
		if res.bad > 0 && r.spec.Errors.Policy != PolicyQuarantine {
			return res, parseBadRow(*firstBad)
		}
		res.fetch = time.Since(t0)
		r.cfg.Metrics.inflight(r.spec.Job, res.n)
		defer r.cfg.Metrics.inflight(r.spec.Job, -res.n)
	} else {
		if _, err := r.goChunk(ctx, tx, a, &res); err != nil {
			return res, err
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
	failpoint.Hit("batch.after_upsert")
	// A forced retryable error, after the chunk wrote its rows: tests make
	// a chunk roll back and retry where they choose.
	if err := failpoint.Error("batch.chunk_error"); err != nil {
		return res, err
	}
	t1 := time.Now()
	// The events were inserted by the upsert's statement (a CTE step over
	// the rows it RETURNed); no document crosses the wire twice.
	failpoint.Hit("batch.after_outbox")
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
	failpoint.Hit("batch.after_checkpoint")
	res.committing = true
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("commit chunk: %w", err)
	}
	failpoint.Hit("batch.after_commit")
	res.commit = time.Since(t1) + res.write
	return res, nil
}

// committed reads, after a COMMIT whose connection was lost, whether the
// chunk's checkpoint (from f.prev to next) is the partition's under this
// lease: the COMMIT got through.
func (r *Runner) committed(ctx context.Context, f *flight, cl *claim, next []string) (bool, error) {
	conn, err := f.slot.ensure(ctx)
	if err != nil {
		return false, err
	}
	cursor, held, err := cl.checkpoint(ctx, conn)
	if err != nil {
		return false, fmt.Errorf("read the checkpoint after a lost COMMIT: %w", err)
	}
	// Not held: not ours any more, the attempt finds out why.
	return held && slices.Equal(cursor, next), nil
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
	tick := time.NewTicker(r.cfg.LeaseTTL / 3)
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
		held, busy, err := cl.waitCheck(ctx, tx, pid)
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

// goChunk is the custom Processor path: read the range (a.Cursor,
// a.Boundary], or the rows a.IDs, process in Go, write back with unnest
// arrays. It returns the ids written (the rows not quarantined).
func (r *Runner) goChunk(ctx context.Context, tx pgx.Tx, a *args, res *chunkResult) ([]string, error) {
	cursor := a.Cursor
	st := r.c.fetchNext
	switch {
	case a.IDs != nil:
		st = r.c.fetchIDs
	case cursor == nil:
		st = r.c.fetchFirst
	}
	t0 := time.Now()
	rows, err := tx.Query(ctx, st.sql, st.bind(a)...)
	if err != nil {
		return nil, fmt.Errorf("fetch chunk after %v: %w", cursor, err)
	}
	var src []SourceRow
	for rows.Next() {
		var sr SourceRow
		var row []byte
		if err := rows.Scan(&sr.ID, &sr.Version, &sr.Deleted, &res.next, &row); err != nil {
			rows.Close()
			return nil, fmt.Errorf("fetch chunk: %w", err)
		}
		sr.Row = row
		src = append(src, sr)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("fetch chunk after %v: %w", cursor, err)
	}
	res.n = len(src)
	res.fetch = time.Since(t0)
	r.cfg.Metrics.inflight(r.spec.Job, len(src))
	defer r.cfg.Metrics.inflight(r.spec.Job, -len(src))
	if len(src) == 0 {
		return nil, nil
	}
	// Process in slices and write each slice as soon as it is ready, so the
	// processor works on slice k+1 while the server writes slice k. All
	// writes are in the chunk's transaction: a later error rolls back all.
	pctx, cancel := context.WithCancel(ctx)
	parts := make(chan goPart, 1)
	go func() {
		defer close(parts)
		for lo := 0; lo < len(src); lo += goWriteSlice {
			t := time.Now()
			p := r.goProcess(pctx, src[lo:min(lo+goWriteSlice, len(src))])
			p.took = time.Since(t)
			select {
			case parts <- p:
			case <-pctx.Done():
				return
			}
			if p.err != nil {
				return
			}
		}
	}()
	defer func() {
		cancel()
		for range parts { // let the producer finish
		}
	}()
	var good []string
	for p := range parts {
		res.proc += p.took
		if p.err != nil {
			return nil, p.err
		}
		t := time.Now()
		var changed int64
		w := *a
		w.IDs, w.Vers, w.Dels, w.Docs = p.ids, p.vers, p.dels, p.docs
		if err := tx.QueryRow(ctx, r.c.write.sql, r.c.write.bind(&w)...).Scan(&changed); err != nil {
			return nil, fmt.Errorf("upsert normalized records and outbox events: %w", err)
		}
		res.changed += changed
		if len(p.badIDs) > 0 {
			q := *a
			q.IDs, q.Codes, q.Msgs = p.badIDs, p.codes, p.msgs
			if _, err := tx.Exec(ctx, r.c.quarantine.sql, r.c.quarantine.bind(&q)...); err != nil {
				return nil, fmt.Errorf("quarantine %d rows: %w", len(p.badIDs), err)
			}
			res.bad += int64(len(p.badIDs))
		}
		good = append(good, p.ids...)
		res.write += time.Since(t)
	}
	return good, nil
}

// goWriteSlice is how many processed rows go into one unnest write. Smaller
// slices overlap the processor with the server's writes, which pays on
// machines with spare cores; on two busy cores it measured a wash, so only
// big chunks are split.
const goWriteSlice = 10000

// goPart is one processed slice of a chunk, ready to write.
type goPart struct {
	ids                 []string
	vers                []int64
	dels                []bool
	docs                []*string
	badIDs, codes, msgs []string
	took                time.Duration
	err                 error
}

// goProcess runs the Processor over rows and applies the bad-row policy.
func (r *Runner) goProcess(ctx context.Context, src []SourceRow) goPart {
	results, err := processConcurrently(ctx, r.cfg.Processor, src, r.spec.Chunk.Concurrency)
	if err != nil {
		return goPart{err: fmt.Errorf("process chunk: %w", err)}
	}
	n := len(src)
	p := goPart{ids: make([]string, 0, n), vers: make([]int64, 0, n), dels: make([]bool, 0, n), docs: make([]*string, 0, n)}
	bad := func(id, code, msg string) {
		p.badIDs, p.codes, p.msgs = append(p.badIDs, id), append(p.codes, code), append(p.msgs, msg)
	}
	for i, sr := range src {
		res := results[i]
		if !sr.Deleted && res.Err != nil {
			code := cmp.Or(res.Code, "processor_error")
			var te *transientError
			switch {
			case r.spec.Errors.Policy == PolicyQuarantine:
				bad(sr.ID, code, res.Err.Error())
				continue
			case r.spec.Errors.Policy == PolicyRetry && errors.As(res.Err, &te):
				return goPart{err: fmt.Errorf("row id=%s: %w", sr.ID, res.Err)}
			default:
				return goPart{err: &BadRowError{ID: sr.ID, Code: code, Message: res.Err.Error()}}
			}
		}
		var doc *string
		if !sr.Deleted {
			if !json.Valid(res.Document) {
				if r.spec.Errors.Policy == PolicyQuarantine {
					bad(sr.ID, "invalid_document", "processor returned invalid JSON")
					continue
				}
				return goPart{err: &BadRowError{ID: sr.ID, Code: "invalid_document", Message: "processor returned invalid JSON"}}
			}
			s := string(res.Document)
			doc = &s
		}
		p.ids, p.vers, p.dels, p.docs = append(p.ids, sr.ID), append(p.vers, sr.Version), append(p.dels, sr.Deleted), append(p.docs, doc)
	}
	return p
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
