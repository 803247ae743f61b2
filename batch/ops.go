package batch

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/user"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxrelay/outboxrelay/internal/tracing"
)

// actor names who moved a checkpoint when the caller does not say.
func actor() string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return u.Username
	}
	return "unknown"
}

// RunStatus is one partition of a run, as `batcher status` shows it.
type RunStatus struct {
	Job, RunID, Partition, State, Mode string
	Cursor, Boundary                   []string
	ProcessorVersion                   string
	Processed, Changed                 int64
	Estimated                          *int64
	Quarantined                        int64 // open quarantine rows of the run partition
	Retries                            int64
	ChunkSize                          *int
	LeaseOwner                         *string
	Attempt                            int
	Error                              *string
	StartedAt, CheckpointAt            *time.Time
	CreatedAt                          time.Time

	// Attempt above counts the claims of the partition (each worker that
	// took it up, after a failure, a crash or a stop); Failures the
	// attempts that failed; LastError the newest failure's message (kept
	// after a successful retry); RetryAt when a failed partition may be
	// retried automatically.
	Failures  int
	LastError *string
	RetryAt   *time.Time

	// Rate is rows per second between the start and the last checkpoint.
	Rate float64
	// CheckpointAge is the time since the last checkpoint (0 if none).
	CheckpointAge time.Duration
}

// Status lists the partitions of the newest runs (at most runs of them per
// job; job "" = every job), newest first. Read from the database, which is
// the source of truth.
func Status(ctx context.Context, db DB, job string, runs int) ([]RunStatus, error) {
	rows, err := db.Query(ctx, statusSQL, job, runs)
	if err != nil {
		return nil, fmt.Errorf("read runs: %w", err)
	}
	defer rows.Close()
	var out []RunStatus
	for rows.Next() {
		var s RunStatus
		var age float64
		if err := rows.Scan(&s.Job, &s.RunID, &s.Partition, &s.State, &s.Mode, &s.Cursor, &s.Boundary, &s.ProcessorVersion,
			&s.Processed, &s.Changed, &s.Estimated, &s.Quarantined, &s.Retries, &s.ChunkSize, &s.LeaseOwner, &s.Attempt, &s.Failures, &s.Error, &s.LastError, &s.RetryAt,
			&s.StartedAt, &s.CheckpointAt, &s.CreatedAt, &age); err != nil {
			return nil, err
		}
		s.CheckpointAge = time.Duration(age * float64(time.Second))
		if s.StartedAt != nil && s.CheckpointAt != nil {
			if d := s.CheckpointAt.Sub(*s.StartedAt).Seconds(); d > 0 {
				s.Rate = float64(s.Processed) / d
			}
		}
		out = append(out, s)
	}
	return out, rows.Err()
}

// OpenWritersWait is a run start that waited for transactions that wrote
// its source table (see [Config].OpenWritersWait), as `batcher status`
// shows it.
type OpenWritersWait struct {
	Job   string
	Table string // the source table, as SQL names it
	// Writers are the transactions waited for when last checked: virtual
	// transaction id and, unless prepared, " (pid N)".
	Writers string
	// Since is when the wait began (the first of a follower's attempts);
	// CheckedAt when the writers were last seen open.
	Since, CheckedAt time.Time
	// ExpiredAt is when the last attempt gave up (nil while it waits).
	ExpiredAt *time.Time
	// Follower: the waiting batcher is a follower, which tries again after
	// giving up.
	Follower bool
	// Current: a batcher waits now, or a follower that gave up tries again
	// soon: checked within the last minute, and not a one-shot run that
	// gave up.
	Current bool
}

const openWritersWaitsSQL = `SELECT job, source, writers, since, checked_at, expired_at, follower,
  checked_at > now() - ` + openWritersFresh + ` AND (expired_at IS NULL OR follower)
FROM batch_open_writers WHERE $1 = '' OR job = $1 ORDER BY job`

// OpenWritersWaits lists the run starts of job ("" = every job) that wait
// or waited for open writers of their source table and have not started
// since.
func OpenWritersWaits(ctx context.Context, db DB, job string) ([]OpenWritersWait, error) {
	rows, err := db.Query(ctx, openWritersWaitsSQL, job)
	if err != nil {
		return nil, fmt.Errorf("read the waits for open writers: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[OpenWritersWait])
}

// SetState pauses (to "paused") or resumes (to "pending") the partitions
// of a run. run "" = the job's newest run; partition "" = all. A worker
// holding a paused partition rolls back its chunk in flight and lets it go.
// It returns how many partitions changed.
func SetState(ctx context.Context, db DB, job, run, partition, to string) (int64, error) {
	var from []string
	switch to {
	case "paused":
		from = []string{"pending", "running"}
	case "pending":
		from = []string{"paused"}
	default:
		return 0, fmt.Errorf("state %q: want paused or pending", to)
	}
	if run == "" {
		if err := db.QueryRow(ctx, newestRunSQL, job).Scan(&run); err != nil {
			if errors.Is(err, pgx.ErrNoRows) {
				return 0, fmt.Errorf("%w: job %s has no runs", ErrNotFound, job)
			}
			return 0, err
		}
	}
	tag, err := db.Exec(ctx, setStateSQL, job, run, partition, from, to)
	if err != nil {
		return 0, fmt.Errorf("set %s/%s to %s: %w", job, run, to, err)
	}
	return tag.RowsAffected(), nil
}

// LoadJobSpec returns the spec the job last ran with.
func LoadJobSpec(ctx context.Context, db DB, job string) (Spec, error) {
	var raw []byte
	if err := db.QueryRow(ctx, loadSpecSQL, job).Scan(&raw); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return Spec{}, fmt.Errorf("%w: job %s has never run (no spec stored)", ErrNotFound, job)
		}
		return Spec{}, err
	}
	s, err := ParseSpec(raw, ".json")
	if err != nil {
		return Spec{}, fmt.Errorf("stored spec of job %s: %w", job, err)
	}
	return s, nil
}

// CheckpointMove is a manual checkpoint move.
type CheckpointMove struct {
	Job, RunID, Partition string
	// Cursor is the new position (the cursor columns' values as text).
	Cursor []string
	Actor  string // default: the OS user
	Reason string // required
}

// CheckpointMoved says what [SetCheckpoint] did.
type CheckpointMoved struct {
	Before, After []string
	// NewRunID is set when the move was backwards: the old run is superseded
	// and a new run starts at the requested position.
	NewRunID string
}

// SetCheckpoint moves a checkpoint by hand and audits it in
// checkpoint_audit. Forward (never past the boundary) moves it in place:
// the skipped rows will not be processed by this run. Backward creates a new
// run from the requested position, because a run's cursor never goes back.
// The partition must not be leased by a live worker: pause it first.
func SetCheckpoint(ctx context.Context, db DB, m CheckpointMove) (*CheckpointMoved, error) {
	if m.Reason == "" {
		return nil, fmt.Errorf("CheckpointMove.Reason is required (stored in checkpoint_audit)")
	}
	m.Actor = cmpOr(m.Actor, actor())
	spec, err := LoadJobSpec(ctx, db, m.Job)
	if err != nil {
		return nil, err
	}
	c, err := compile(ctx, db, spec)
	if err != nil {
		return nil, err
	}
	if len(m.Cursor) != len(c.cur) {
		return nil, fmt.Errorf("cursor has %d values, job %s's cursor is %v", len(m.Cursor), m.Job, spec.Source.Cursor)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	var (
		state     string
		cur, bnd  []string
		processed int64
		leased    bool
	)
	err = tx.QueryRow(ctx, lockCheckpointMoveSQL, m.Job, m.RunID, m.Partition).Scan(&state, &cur, &bnd, &processed, &leased)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("%w: run %s/%s partition %q", ErrNotFound, m.Job, m.RunID, m.Partition)
	}
	if err != nil {
		return nil, err
	}
	if state == "running" && leased {
		return nil, fmt.Errorf("run %s/%s partition %q is leased by a live worker: pause it first (batcher pause)", m.Job, m.RunID, m.Partition)
	}
	if state == "succeeded" || state == "superseded" {
		return nil, fmt.Errorf("run %s/%s partition %q is %s; start a new run instead", m.Job, m.RunID, m.Partition, state)
	}
	// Compare with the cursor columns' real types.
	b := newBuilder()
	typed := func(name string) string {
		vals := ""
		for i, t := range c.curT {
			if i > 0 {
				vals += ", "
			}
			vals += fmt.Sprintf("(%s)[%d]::%s", b.p(name, "text[]"), i+1, t)
		}
		return "(" + vals + ")"
	}
	st := b.stmt(`SELECT ` + b.p("cur", "text[]") + ` IS NULL OR ` + typed("new") + ` > ` + typed("cur") + `, ` + typed("new") + ` <= ` + typed("bnd") + `, ` + typed("new") + ` = ` + typed("cur") + ` IS TRUE`)
	var forward, within, same bool
	if err := tx.QueryRow(ctx, st.sql, st.bind(&args{Cur: cur, New: m.Cursor, Bd: bnd})...).Scan(&forward, &within, &same); err != nil {
		return nil, fmt.Errorf("cursor %v does not fit job %s's cursor columns %v: %w", m.Cursor, m.Job, spec.Source.Cursor, err)
	}
	if same {
		return nil, fmt.Errorf("the checkpoint is already at %v", m.Cursor)
	}
	if !within {
		return nil, fmt.Errorf("%w: cursor %v is past the run's boundary %v", ErrCheckpointInvariant, m.Cursor, bnd)
	}
	out := &CheckpointMoved{Before: cur, After: m.Cursor}
	if forward {
		if _, err := tx.Exec(ctx, moveCheckpointSQL, m.Job, m.RunID, m.Partition, m.Cursor); err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, auditForwardSQL,
			m.Job, m.RunID, m.Partition, m.Actor, m.Reason, cur, m.Cursor, processed); err != nil {
			return nil, err
		}
		return out, tx.Commit(ctx)
	}
	// Backwards: a new run, every partition copied, this one at the new
	// position with its count restarted.
	out.NewRunID = time.Now().UTC().Format("20060102T150405.000Z")
	if _, err := tx.Exec(ctx, copyRunSQL, m.Job, m.RunID, out.NewRunID, m.Partition, m.Cursor); err != nil {
		return nil, err
	}
	if _, err := tx.Exec(ctx, supersedeRunSQL, m.Job, m.RunID); err != nil {
		return nil, err
	}
	// The new run sweeps instead of the old one.
	if _, err := tx.Exec(ctx, supersedeSweepSQL, m.Job, m.RunID); err != nil {
		return nil, err
	}
	if spec.Vanished == VanishedDelete || spec.Document.HasRelations() {
		// A relation job's sweep phase rebuilds the roots its related
		// changes queued (nothing when none are).
		if _, err := tx.Exec(ctx, createSweepSQL, m.Job, out.NewRunID); err != nil {
			return nil, err
		}
	}
	if _, err := tx.Exec(ctx, auditBackwardSQL,
		m.Job, m.RunID, m.Partition, m.Actor, m.Reason, cur, m.Cursor, processed, out.NewRunID); err != nil {
		return nil, err
	}
	return out, tx.Commit(ctx)
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// QuarantinedRow is one row of batch_quarantine.
type QuarantinedRow struct {
	Job, RunID, Partition, SourceID, Code, Message string
	Attempts                                       int
	FirstSeen, LastSeen                            time.Time
	ResolvedAt                                     *time.Time
}

// ListQuarantine returns the job's quarantined rows (all = include
// resolved ones).
func ListQuarantine(ctx context.Context, db DB, job string, all bool) ([]QuarantinedRow, error) {
	rows, err := db.Query(ctx, listQuarantineSQL, job, all)
	if err != nil {
		return nil, fmt.Errorf("read quarantine: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (QuarantinedRow, error) {
		var q QuarantinedRow
		err := r.Scan(&q.Job, &q.RunID, &q.Partition, &q.SourceID, &q.Code, &q.Message, &q.Attempts, &q.FirstSeen, &q.LastSeen, &q.ResolvedAt)
		return q, err
	})
}

// RetryResult says what [RetryQuarantine] did.
type RetryResult struct {
	Retried, Resolved, StillBad int64
}

// RetryOptions are the choices of [RetryQuarantine].
type RetryOptions struct {
	// Rebuild declares a retry at a processor version that was live
	// before and is not now (see [LiveVersionError]), as
	// StartOptions.Rebuild does for a run.
	Rebuild bool
}

// RetryQuarantine reprocesses the job's open quarantined rows from the
// source table with spec (normally the job's stored spec, perhaps with a
// fixed processor): rows that now normalize are upserted and enqueued in the
// same transaction that marks them resolved; the others stay with attempts
// incremented. No checkpoint moves. proc nil = built-in normalizer. A spec
// at a processor version that was live before and is not now is refused
// with a [LiveVersionError] unless opts.Rebuild. Each batch of ids holds
// the job lock, as a run's start does: a run starting meanwhile waits for
// it, so the deletes it drains come after what the retry wrote.
func RetryQuarantine(ctx context.Context, db DB, spec Spec, proc Processor, opts RetryOptions) (RetryResult, error) {
	var out RetryResult
	spec = spec.withDefaults()
	if err := spec.validate(); err != nil {
		return out, err
	}
	if err := refuseStale(ctx, db, spec, opts.Rebuild); err != nil {
		return out, err
	}
	c, err := compile(ctx, db, spec)
	if err != nil {
		return out, err
	}
	rows, err := db.Query(ctx, openQuarantineSQL, spec.Job)
	if err != nil {
		return out, err
	}
	type group struct {
		run, key string
		ids      []string
	}
	groups, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (group, error) {
		var g group
		return g, r.Scan(&g.run, &g.key, &g.ids)
	})
	if err != nil {
		return out, err
	}
	r := &Runner{spec: spec, c: c, cfg: Config{Processor: proc}.withDefaults()}
	for _, g := range groups {
		for ids := range slices.Chunk(g.ids, 1000) {
			n, resolved, err := r.retryIDs(ctx, db, g.run, g.key, ids)
			if err != nil {
				return out, err
			}
			out.Retried += int64(len(ids))
			out.Resolved += resolved
			_ = n
		}
	}
	out.StillBad = out.Retried - out.Resolved
	return out, nil
}

func (r *Runner) retryIDs(ctx context.Context, db DB, run, key string, ids []string) (int, int64, error) {
	// As a scan chunk's: the span's traceparent goes into the events of
	// the rows that now pass.
	ctx, span := tracing.Start(ctx, "batch.quarantine_retry")
	defer span.End()
	tx, err := db.Begin(ctx)
	if err != nil {
		return 0, 0, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	a := &args{IDs: ids, PKey: key, Job: r.spec.Job, Run: run, Source: r.spec.SourceName, PV: r.spec.ProcessorVersion, TP: tracing.Arg(ctx)}
	// The job lock orders the retry with the drain of a run's deletes
	// (prepareRun holds it): a row deleted while it is reprocessed is
	// drained after the retry wrote it, not before (which left it live for
	// good: the drain had no normalized row to tombstone and moved its mark
	// past the capture).
	if _, err := tx.Exec(ctx, lockJobSQL, r.spec.Job); err != nil {
		return 0, 0, err
	}
	if len(r.c.rels) > 0 {
		// No chunk of the job rebuilds these roots meanwhile.
		if _, err := tx.Exec(ctx, relLockSQL, r.spec.Job); err != nil {
			return 0, 0, err
		}
	}
	var n int
	var resolved int64
	if r.cfg.Processor == nil {
		var bad, changed int64
		var first *string
		var last []string
		st := r.c.chunkIDs
		if len(r.c.rels) > 0 && key == "" && r.spec.Source.Partition != "" {
			// Quarantined by the relation phase, which works on every
			// partition at once (no partition key).
			st = r.c.chunkWork
		}
		if err := tx.QueryRow(ctx, st.sql, st.bind(a)...).Scan(&n, &bad, &first, &changed, &last); err != nil {
			return 0, 0, fmt.Errorf("retry quarantined rows: %w", err)
		}
		resolved = int64(n) - bad
	} else {
		saved := r.spec.Errors.Policy
		r.spec.Errors.Policy = PolicyQuarantine // still-bad rows stay quarantined
		var res chunkResult
		good, err := r.goChunk(ctx, tx, a, &res, false)
		r.spec.Errors.Policy = saved
		if err != nil {
			return 0, 0, err
		}
		n = res.n
		resolved = int64(res.n) - res.bad
		if res.n == 0 {
			good = ids // gone from the source: nothing left to retry
		}
		a.IDs = good
		if _, err := tx.Exec(ctx, r.c.resolve.sql, r.c.resolve.bind(a)...); err != nil {
			return 0, 0, err
		}
	}
	return n, resolved, tx.Commit(ctx)
}

// MarshalJSON keeps durations readable in `status --json`.
func (s RunStatus) MarshalJSON() ([]byte, error) {
	type alias RunStatus
	return json.Marshal(struct {
		alias
		CheckpointAge string
	}{alias(s), s.CheckpointAge.String()})
}
