package batch

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
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
	// OpenWritersWait bounds how long a run start waits for the
	// transactions that had written the source table when it read its
	// boundaries (they may still commit rows below them). Past it the run
	// does not start: [Runner.Prepare] and [Runner.Run] return an
	// [OpenWritersError], and a [Follower] logs it and tries again. While a
	// start waits, batch_open_writers says so (see [OpenWritersWaits]).
	// Default [DefaultOpenWritersWait]; negative: no limit.
	OpenWritersWait time.Duration

	// follower: the runs are a Follower's, which starts again after an
	// OpenWritersError (batch_open_writers says so).
	follower bool
	// compiles: the follower's compiled spec, kept across its runs.
	compiles *compileCache
}

// DefaultOpenWritersWait is [Config].OpenWritersWait's default.
const DefaultOpenWritersWait = 2 * time.Minute

func (c Config) withDefaults() Config {
	if c.WorkerID == "" {
		host, _ := os.Hostname()
		c.WorkerID = cmp.Or(host, "worker") + "-" + strconv.Itoa(os.Getpid())
	}
	c.Workers = cmp.Or(c.Workers, 1)
	c.LeaseTTL = cmp.Or(c.LeaseTTL, 30*time.Second)
	c.HeartbeatInterval = cmp.Or(c.HeartbeatInterval, c.LeaseTTL/3)
	c.OpenWritersWait = cmp.Or(c.OpenWritersWait, DefaultOpenWritersWait)
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
	if c.Processor != nil && s.Document.HasRelations() {
		return fmt.Errorf("%w: job %s: a custom Processor cannot build documents with document.relations (it sees the root row only); "+
			"leave the relations out and read the related rows in the Processor, or use the built-in normalizer", ErrSpec, s.Job)
	}
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
	cfg.Metrics.forJob(spec.Job)
	return &Runner{pool: pool, spec: spec, cfg: cfg, limiter: newLimiter(cfg.RateLimit, cfg.RateBurst)}, nil
}

// Prepare checks the spec against the database (table and columns exist),
// then finds, creates or refuses the run (see [StartOptions]). It returns
// the run id. Run calls it when it was not called. A new run waits for the
// transactions that wrote the source table up to [Config].OpenWritersWait,
// then returns an [OpenWritersError] and changes nothing.
func (r *Runner) Prepare(ctx context.Context) (string, error) {
	if r.runID != "" {
		return r.runID, nil
	}
	var c *compiled
	var err error
	if r.cfg.compiles != nil {
		c, err = r.cfg.compiles.get(ctx, r.pool, r.spec)
	} else {
		c, err = compile(ctx, r.pool, r.spec)
	}
	if err != nil {
		return "", err
	}
	r.c = c
	if len(c.rels) > 0 && !r.cfg.follower {
		missing, err := c.unindexedJoins(ctx, r.pool)
		if err != nil {
			return "", err
		}
		for _, m := range missing {
			r.cfg.Logger.Warn("a join column of the job's relations has no index", slog.String("job", r.spec.Job), slog.String("column", m))
		}
	}
	id, err := prepareRun(ctx, r.pool, c, r.cfg.StartOptions, time.Now(), openWriters{db: r.pool, wait: r.cfg.OpenWritersWait, metrics: r.cfg.Metrics, follower: r.cfg.follower})
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
		rest    int                  // the second half of a split last chunk
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
				if rest > 0 {
					f.size, rest = rest, 0
				}
				n, end, err := r.planChunk(ctx, conn, cl, next, f.size)
				if err == nil && n < f.size && n >= 2*r.spec.Chunk.Min {
					// The last chunk: split it in two, so that its halves run
					// side by side instead of the whole of it alone on one
					// core while the other connection idles (a quarter of a
					// 100,000-row run's time). The next launch takes the rest.
					rest = n - (n+1)/2
					f.size = (n + 1) / 2
					n, end, err = r.planChunk(ctx, conn, cl, next, f.size)
				}
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
				replan, next, more, rest = false, cursor, true, 0
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
			case errors.Is(f.err, errYield):
				// It let the chunk before it through; start again from
				// the checkpoint that chunk leaves.
				replan = true
			case errors.Is(f.err, errNotFresh):
				// Guarded from now on (the claim's flag is off, and so is
				// the partition's, for a later claim); the chunks behind it
				// roll back and everything runs again from the checkpoint.
				log.Info("a first load's chunk met a row or event that was there already; writing the partition with the guarded upsert from its checkpoint",
					slog.String("error", f.err.Error()), slog.Any("cursor", cursor))
				if err := cl.notFresh(cleanup()); err != nil {
					log.Warn("record the end of plain INSERTs", slog.String("error", err.Error()))
				}
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
