package manifest

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxrelay/outboxrelay/outbox"
)

// Failpoints of a manifest chunk (internal/failpoint): the process kills
// itself there when OUTBOXRELAY_FAILPOINT names one.
const (
	FailpointAfterUpdate    = "manifest.after_update"     // target rows updated, nothing else
	FailpointAfterAudit     = "manifest.after_audit"      // + audit rows
	FailpointAfterNextIndex = "manifest.after_next_index" // + outbox events and next_index, not committed
	FailpointAfterCommit    = "manifest.after_commit"     // committed, the client has not answered
)

// DefaultLockTimeout bounds how long a chunk waits for a lock on a
// target row (another writer holding an order). Waiting for the job row
// itself (another drain running a chunk) is not bounded by it.
const DefaultLockTimeout = 5 * time.Second

// DefaultIdleTimeout is DrainOptions.IdleTimeout's default.
const DefaultIdleTimeout = 30 * time.Second

// DrainOptions tune Drain.
type DrainOptions struct {
	// MaxChunks is how many chunks this call may commit. 0 means until the
	// job completes.
	MaxChunks int
	// LockTimeout bounds the wait for target row locks inside a chunk
	// (default DefaultLockTimeout; negative means wait forever). A
	// timeout rolls the chunk back and ends the drain with the error.
	LockTimeout time.Duration
	// IdleTimeout bounds how long a chunk transaction, which holds the job
	// row, may sit idle between two statements (a drainer stuck outside the
	// server). Past it the server ends the session: the chunk rolls back,
	// the job row is free for another drainer, and the stuck one cannot
	// commit. Default DefaultIdleTimeout; negative means no bound.
	IdleTimeout time.Duration
	// Stop, when closed, lets the chunk in flight finish and starts no
	// other (a soft stop). Cancel ctx to abort the chunk in flight.
	Stop <-chan struct{}
	// OnChunk is called after each chunk commits.
	OnChunk func(Chunk)
	// Logger (default: discard).
	Logger *slog.Logger
}

// Chunk is one committed chunk.
type Chunk struct {
	// Chunk is the chunk's number (From / chunk size, 0-based).
	Chunk int `json:"chunk"`
	// From and To bound the chunk's positions in the frozen list: [From, To).
	From int `json:"from"`
	To   int `json:"to"`
	// IDs changed (and audited) by the chunk, in list order.
	IDs []string `json:"ids"`
	// Events is how many outbox events the chunk enqueued.
	Events    int64         `json:"events"`
	NextIndex int           `json:"next_index"`
	ItemCount int           `json:"item_count"`
	State     string        `json:"state"`
	Duration  time.Duration `json:"duration_ns"`
}

// Why a drain stopped (DrainResult.Stopped).
const (
	StoppedCompleted = "completed"  // the job is succeeded (maybe by another worker)
	StoppedMaxChunks = "max_chunks" // MaxChunks committed
	StoppedSignal    = "stop"       // Stop was closed
	StoppedConflict  = "conflict"   // the job is conflicted
)

// DrainResult is what one Drain call did. It is not the
// job's history: a call that finds the job finished by another worker
// returns no chunks. Read the job's progress from the database
// (GetJob, ReadReport).
type DrainResult struct {
	JobID        string   `json:"job_id"`
	Chunks       []Chunk  `json:"chunks"`
	ProcessedIDs []string `json:"processed_ids"`
	NextIndex    int      `json:"next_index"`
	ItemCount    int      `json:"item_count"`
	State        string   `json:"state"`
	Stopped      string   `json:"stopped"`
}

// Conflict records why a job stopped as conflicted: the chunk that
// rolled back and each of its items that no longer matched.
type Conflict struct {
	Chunk      int            `json:"chunk"`
	From       int            `json:"from"`
	To         int            `json:"to"`
	Items      []ItemConflict `json:"items"`
	DetectedAt time.Time      `json:"detected_at"`
}

// ItemConflict is one item that no longer matched its approval.
type ItemConflict struct {
	Seq         int      `json:"seq"`
	ID          string   `json:"id"`
	Differences []string `json:"differences"`
}

func (c *Conflict) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "chunk %d (positions %d..%d) rolled back", c.Chunk, c.From, c.To-1)
	for _, it := range c.Items {
		fmt.Fprintf(&b, "; id %s (position %d): %s", it.ID, it.Seq, strings.Join(it.Differences, ", "))
	}
	return b.String()
}

// ConflictError: the job is conflicted. It wraps ErrConflicted.
type ConflictError struct {
	JobID    string
	Conflict *Conflict
	// Now is true when this call found the conflict (false: the job was
	// conflicted before).
	Now bool
}

func (e *ConflictError) Error() string {
	what := "is conflicted"
	if e.Now {
		what = "is now conflicted"
	}
	detail := "no detail recorded"
	if e.Conflict != nil {
		detail = e.Conflict.String()
	}
	return fmt.Sprintf("manifest job %q %s: %s; finished chunks stay, nothing is retried: a new approval is needed for the rest", e.JobID, what, detail)
}

func (e *ConflictError) Unwrap() error { return ErrConflicted }

// ProgressError: verification found next_index and the audit
// disagreeing with the frozen list. Nothing was changed. It wraps
// ErrProgressMismatch.
type ProgressError struct {
	JobID     string
	NextIndex int
	ItemCount int
	ChunkSize int
	Problems  []string
}

func (e *ProgressError) Error() string {
	return fmt.Sprintf("manifest job %q: progress verification failed (next_index %d of %d items, chunk size %d): %s; nothing was changed or repaired",
		e.JobID, e.NextIndex, e.ItemCount, e.ChunkSize, strings.Join(e.Problems, "; "))
}

func (e *ProgressError) Unwrap() error { return ErrProgressMismatch }

// Drain applies the next chunks of a job, one transaction per chunk.
// Each chunk locks the job row FOR UPDATE (so two drains of one job take
// turns), verifies the progress against the audit, applies the approved
// transition to the next chunk of the frozen list with one conditional
// UPDATE, writes an audit row per item, enqueues an outbox event per changed
// row and advances next_index. It stops when the job completes, after
// opts.MaxChunks, on opts.Stop, or at the first conflict or error, which it
// returns without retrying: a *ConflictError (the chunk rolled back,
// the job is now conflicted), a *ProgressError (nothing changed),
// or a database error.
func Drain(ctx context.Context, db DB, jobID string, opts DrainOptions) (DrainResult, error) {
	d := &drainer{db: db, jobID: jobID, opts: opts}
	d.opts.LockTimeout = cmp.Or(opts.LockTimeout, DefaultLockTimeout)
	d.opts.IdleTimeout = cmp.Or(opts.IdleTimeout, DefaultIdleTimeout)
	if d.opts.Logger == nil {
		d.opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.MaxChunks < 0 {
		return DrainResult{}, fmt.Errorf("MaxChunks=%d: must be >= 0 (0 = until the job completes)", opts.MaxChunks)
	}
	res := DrainResult{JobID: jobID, Chunks: []Chunk{}, ProcessedIDs: []string{}}
	for {
		if opts.MaxChunks > 0 && len(res.Chunks) >= opts.MaxChunks {
			res.Stopped = StoppedMaxChunks
			return res, nil
		}
		if opts.Stop != nil {
			select {
			case <-opts.Stop:
				res.Stopped = StoppedSignal
				return res, nil
			default:
			}
		}
		chunk, job, err := d.step(ctx)
		res.NextIndex, res.ItemCount, res.State = job.NextIndex, job.ItemCount, job.State
		if err != nil {
			if errors.Is(err, ErrConflicted) {
				res.Stopped = StoppedConflict
			}
			return res, err
		}
		if chunk == nil {
			res.Stopped = StoppedCompleted
			return res, nil
		}
		res.Chunks = append(res.Chunks, *chunk)
		res.ProcessedIDs = append(res.ProcessedIDs, chunk.IDs...)
		res.NextIndex, res.State = chunk.NextIndex, chunk.State
		if opts.OnChunk != nil {
			opts.OnChunk(*chunk)
		}
		if chunk.NextIndex == chunk.ItemCount {
			res.Stopped = StoppedCompleted
			return res, nil
		}
	}
}

type drainer struct {
	db     DB
	jobID  string
	opts   DrainOptions
	target *targetSQL
	// verified is how far this drain has checked the audit: every later
	// chunk only checks what was added since (by this or another worker).
	verified int
}

// step runs one chunk transaction. It returns a nil chunk when the job is
// complete.
func (d *drainer) step(ctx context.Context) (*Chunk, Job, error) {
	start := time.Now()
	tx, err := d.db.Begin(ctx)
	if err != nil {
		return nil, Job{}, fmt.Errorf("manifest job %s: begin: %w", d.jobID, err)
	}
	// After a commit this is a no-op; on any error it ends the transaction
	// even if ctx was cancelled.
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	idle := "0"
	if d.opts.IdleTimeout > 0 {
		idle = fmt.Sprintf("%dms", max(d.opts.IdleTimeout.Milliseconds(), 1))
	}
	if _, err := tx.Exec(ctx, chunkSettingsSQL, idle); err != nil {
		return nil, Job{}, fmt.Errorf("manifest job %s: set idle_in_transaction_session_timeout=%s: %w", d.jobID, idle, err)
	}

	job, err := loadJob(ctx, tx, lockJobSQL, d.jobID)
	if err != nil {
		return nil, job, err
	}
	if job.State == StateConflicted {
		return nil, job, &ConflictError{JobID: d.jobID, Conflict: job.Conflict}
	}
	if problems, err := verifyProgress(ctx, tx, job, d.verified); err != nil {
		return nil, job, err
	} else if len(problems) > 0 {
		return nil, job, &ProgressError{JobID: d.jobID, NextIndex: job.NextIndex, ItemCount: job.ItemCount, ChunkSize: job.ChunkSize, Problems: problems}
	}
	d.verified = job.NextIndex
	if job.NextIndex == job.ItemCount {
		return nil, job, nil
	}
	if d.target == nil {
		if d.target, err = resolveTarget(ctx, tx, job.Target); err != nil {
			return nil, job, fmt.Errorf("manifest job %s: %w", d.jobID, err)
		}
	}
	if d.opts.LockTimeout > 0 {
		// Set after the job row is ours: waiting for another drain's chunk is
		// expected, waiting long for an order another writer holds is not.
		if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, fmt.Sprintf("%dms", d.opts.LockTimeout.Milliseconds())); err != nil {
			return nil, job, fmt.Errorf("manifest job %s: set lock_timeout: %w", d.jobID, err)
		}
	}

	from := job.NextIndex
	to := min(from+job.ChunkSize, job.ItemCount)
	chunkNo := from / job.ChunkSize
	log := d.opts.Logger.With(slog.String("job", d.jobID), slog.Int("chunk", chunkNo), slog.Int("from", from), slog.Int("to", to))

	// A savepoint around the UPDATE: on a mismatch it is undone, and the
	// conflict is recorded in the same transaction that still holds the job
	// row, so no other drain can slip in between.
	sp, err := tx.Begin(ctx)
	if err != nil {
		return nil, job, fmt.Errorf("manifest job %s: savepoint: %w", d.jobID, err)
	}
	changed, err := d.update(ctx, sp, job, from, to)
	if err != nil {
		return nil, job, fmt.Errorf("manifest job %s chunk %d: update %s: %w", d.jobID, chunkNo, d.target.table, err)
	}
	hit(FailpointAfterUpdate)
	if len(changed) != to-from {
		if err := sp.Rollback(ctx); err != nil {
			return nil, job, fmt.Errorf("manifest job %s chunk %d: roll back to savepoint: %w", d.jobID, chunkNo, err)
		}
		conflict, err := d.explain(ctx, tx, job, from, to)
		if err != nil {
			return nil, job, err
		}
		conflict.Chunk = chunkNo
		if _, err := tx.Exec(ctx, markConflictedSQL, d.jobID, conflict); err != nil {
			return nil, job, fmt.Errorf("manifest job %s: mark conflicted: %w", d.jobID, err)
		}
		if err := tx.Commit(ctx); err != nil {
			return nil, job, fmt.Errorf("manifest job %s: commit conflicted state: %w", d.jobID, err)
		}
		job.State, job.Conflict = StateConflicted, conflict
		log.Warn("manifest chunk rolled back: an item no longer matches its approval", slog.Int("matched", len(changed)), slog.String("conflict", conflict.String()))
		return nil, job, &ConflictError{JobID: d.jobID, Conflict: conflict, Now: true}
	}
	if err := sp.Commit(ctx); err != nil {
		return nil, job, fmt.Errorf("manifest job %s chunk %d: release savepoint: %w", d.jobID, chunkNo, err)
	}

	headers, err := liveHeaders(ctx, tx, job)
	if err != nil {
		return nil, job, err
	}
	n := len(changed)
	seqs, ids, befores, afters, fields, afterFields := make([]int32, n), make([]string, n), make([]int64, n), make([]int64, n), make([]string, n), make([]string, n)
	events := make([]outbox.Event, n)
	for i, c := range changed {
		seqs[i], ids[i], befores[i], afters[i] = int32(c.seq), c.id, c.before, c.after
		fields[i], afterFields[i] = string(c.fields), string(c.afterFields)
		events[i] = outbox.Event{
			ID:               outbox.EventID("manifest:"+d.jobID, c.id, c.after, "manifest"),
			Topic:            job.Topic,
			AggregateType:    job.Target.Table,
			AggregateID:      c.id,
			AggregateVersion: c.after,
			Type:             outbox.TypeUpsert,
			Payload:          c.doc,
			Headers:          headers,
		}
	}
	if _, err := tx.Exec(ctx, insertAuditSQL, d.jobID, chunkNo, job.Transition.From, job.Transition.To, seqs, ids, befores, afters, fields, afterFields); err != nil {
		return nil, job, fmt.Errorf("manifest job %s chunk %d: insert audit: %w", d.jobID, chunkNo, err)
	}
	hit(FailpointAfterAudit)
	enqueued, err := outbox.Enqueue(ctx, tx, events...)
	if err != nil {
		return nil, job, fmt.Errorf("manifest job %s chunk %d: %w", d.jobID, chunkNo, err)
	}
	state := StateRunning
	if to == job.ItemCount {
		state = StateSucceeded
	}
	tag, err := tx.Exec(ctx, advanceSQL, d.jobID, from, to, state)
	if err != nil {
		return nil, job, fmt.Errorf("manifest job %s chunk %d: advance next_index: %w", d.jobID, chunkNo, err)
	}
	if tag.RowsAffected() != 1 {
		return nil, job, fmt.Errorf("manifest job %s chunk %d: next_index moved from %d under the job lock; chunk rolled back", d.jobID, chunkNo, from)
	}
	hit(FailpointAfterNextIndex)
	if err := tx.Commit(ctx); err != nil {
		return nil, job, fmt.Errorf("manifest job %s chunk %d: commit: %w", d.jobID, chunkNo, err)
	}
	hit(FailpointAfterCommit)
	d.verified = to
	job.NextIndex, job.State = to, state
	chunk := &Chunk{
		Chunk: chunkNo, From: from, To: to, IDs: ids, Events: enqueued,
		NextIndex: to, ItemCount: job.ItemCount, State: state, Duration: time.Since(start),
	}
	log.Info("manifest chunk committed", slog.Int("items", n), slog.Int64("events", enqueued),
		slog.Int("next_index", to), slog.Int("item_count", job.ItemCount), slog.Duration("duration", chunk.Duration))
	return chunk, job, nil
}

type changedRow struct {
	seq           int
	id            string
	before, after int64
	// fields are the approved fields the UPDATE matched; afterFields the
	// match fields as the row holds them after it (and its triggers).
	fields, afterFields, doc json.RawMessage
}

func (d *drainer) update(ctx context.Context, tx pgx.Tx, job Job, from, to int) ([]changedRow, error) {
	rows, err := tx.Query(ctx, d.target.update, d.target.keyArgs(d.jobID, from, to, job.Transition.To, job.Tenant, job.Transition.From)...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (changedRow, error) {
		var c changedRow
		var seq int32
		err := r.Scan(&seq, &c.id, &c.before, &c.after, &c.fields, &c.afterFields, &c.doc)
		c.seq = int(seq)
		return c, err
	})
}

// explain reads the chunk's items and current rows (after the UPDATE was
// undone) and says, for each item that no longer matches, what differs.
func (d *drainer) explain(ctx context.Context, tx pgx.Tx, job Job, from, to int) (*Conflict, error) {
	rows, err := tx.Query(ctx, d.target.explain, d.target.keyArgs(d.jobID, from, to)...)
	if err != nil {
		return nil, fmt.Errorf("manifest job %s: read the chunk's current rows: %w", d.jobID, err)
	}
	c := &Conflict{From: from, To: to, Items: []ItemConflict{}, DetectedAt: time.Now().UTC()}
	var (
		seq                      int32
		id, tenant, status       string
		approvedRev, rev         int64
		approvedFields, curField map[string]json.RawMessage
		found                    bool
		badKeys                  []string
	)
	_, err = pgx.ForEachRow(rows, []any{&seq, &id, &approvedRev, &approvedFields, &found, &tenant, &rev, &status, &curField, &badKeys}, func() error {
		want := rowState{found: true, tenant: job.Tenant, revision: approvedRev, status: job.Transition.From, fields: approvedFields}
		got := rowState{found: found, tenant: tenant, revision: rev, status: status, fields: curField}
		diffs := compareRow(want, got, badKeys, "approved", "found")
		if len(diffs) > 0 {
			c.Items = append(c.Items, ItemConflict{Seq: int(seq), ID: id, Differences: diffs})
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("manifest job %s: read the chunk's current rows: %w", d.jobID, err)
	}
	if len(c.Items) == 0 {
		// Every item matches now: a concurrent writer changed a row and
		// changed it back while the UPDATE ran. Still a rollback.
		c.Items = append(c.Items, ItemConflict{Seq: from, ID: "?", Differences: []string{"a row changed while the chunk ran; no difference is visible now"}})
	}
	return c, nil
}

// verifyProgress checks next_index against the audit and the frozen
// list: every position in [verified, next_index) has an audit row with the
// same id, before revision = approved revision, after revision = approved + 1
// and the approved fields; no audit row past next_index; next_index at a
// chunk boundary and not past the end. It returns the problems found.
func verifyProgress(ctx context.Context, q querier, job Job, verified int) ([]string, error) {
	var problems []string
	switch {
	case job.NextIndex > job.ItemCount:
		problems = append(problems, fmt.Sprintf("next_index %d is past the end of the %d approved items", job.NextIndex, job.ItemCount))
	case job.NextIndex%job.ChunkSize != 0 && job.NextIndex != job.ItemCount:
		problems = append(problems, fmt.Sprintf("next_index %d points into the middle of chunk %d (chunk size %d)", job.NextIndex, job.NextIndex/job.ChunkSize, job.ChunkSize))
	}
	if job.State == StateSucceeded && job.NextIndex != job.ItemCount {
		problems = append(problems, fmt.Sprintf("state is succeeded but next_index is %d of %d", job.NextIndex, job.ItemCount))
	}
	if job.NextIndex == job.ItemCount && (job.State == StatePending || job.State == StateRunning) {
		problems = append(problems, fmt.Sprintf("next_index is at the end (%d) but state is %s", job.NextIndex, job.State))
	}
	from := min(verified, job.NextIndex)
	rows, err := q.Query(ctx, verifySQL, job.JobID, from, job.NextIndex)
	if err != nil {
		return nil, fmt.Errorf("manifest job %s: verify progress: %w", job.JobID, err)
	}
	var (
		seq                       int32
		hasItem, hasAudit, sameFs bool
		itemID, auditID           string
		rev, before, after        int64
	)
	_, err = pgx.ForEachRow(rows, []any{&seq, &hasItem, &hasAudit, &itemID, &auditID, &rev, &before, &after, &sameFs}, func() error {
		switch {
		case !hasAudit:
			problems = append(problems, fmt.Sprintf("position %d (id %s) is before next_index but has no audit row", seq, itemID))
		case !hasItem && int(seq) >= job.ItemCount:
			problems = append(problems, fmt.Sprintf("audit row at position %d (id %s) is past the end of the %d approved items", seq, auditID, job.ItemCount))
		case !hasItem:
			problems = append(problems, fmt.Sprintf("audit row at position %d (id %s) is at or past next_index %d", seq, auditID, job.NextIndex))
		case auditID != itemID:
			problems = append(problems, fmt.Sprintf("audit row at position %d has id %s, the approved list has %s", seq, auditID, itemID))
		case before != rev || after != rev+1:
			problems = append(problems, fmt.Sprintf("audit row at position %d (id %s) has revisions %d → %d, the approval says %d → %d", seq, itemID, before, after, rev, rev+1))
		case !sameFs:
			problems = append(problems, fmt.Sprintf("audit row at position %d (id %s) has other field values than the approval", seq, itemID))
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("manifest job %s: verify progress: %w", job.JobID, err)
	}
	return problems, nil
}
