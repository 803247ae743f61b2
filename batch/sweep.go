package batch

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"

	"github.com/outboxrelay/outboxrelay/internal/tracing"
)

// The sweep of a full run (Spec.Vanished = delete): once every partition
// succeeded, the live rows of normalized_records for the job's source name
// whose source row is no longer in the run's scope become tombstones and
// delete events. It goes through normalized_records by source_id in chunks;
// each chunk is one transaction with its tombstones, its events and its
// checkpoint (batch_sweeps.cursor), fenced by the sweep's lease token and
// the previous cursor like a partition's chunk. A crash anywhere resumes
// from the last committed chunk, and a chunk swept twice changes nothing
// (a tombstone is not a live row, and a vanished one is not read again).
// Soft-deleted rows whose source row is gone are marked vanished, without
// an event (see sweepSQL).

// Failpoints of a sweep chunk.
const (
	failpointSweepAfterDelete     = "batch.sweep_after_delete"     // tombstones and events written, not checkpointed
	failpointSweepAfterCheckpoint = "batch.sweep_after_checkpoint" // + checkpoint, not committed
	failpointSweepAfterCommit     = "batch.sweep_after_commit"     // committed
)

// sweepOnResumeSQL is what resuming a run does to its sweep: retry it if
// it failed, or, when the spec now says vanished: keep, drop it.
func sweepOnResumeSQL(s Spec) string {
	if s.Vanished == VanishedKeep && !s.Document.HasRelations() {
		return supersedeSweepSQL
	}
	return retrySweepSQL
}

// sweepSQL is one sweep chunk: the next live rows of the source name after
// the cursor, those whose source row is not in scope any more, their
// tombstones (version + 1, guarded by the version the chunk read, so a
// concurrent newer upsert wins) and one delete event each. Tombstones of
// another processor version (a row that vanished before a rebuild) whose
// row is still gone are candidates too: they move to the run's version at
// the same source version, with a delete event of that version, so the new
// index generation holds the tombstone and the cutover check (every row at
// the new version) can pass. A soft-deleted row of the run's version not
// yet marked vanished (its tombstone is indexed) whose source row is gone
// (hard-deleted, truncated, out of scope) is a candidate too: it is marked
// vanished, with no new event, so that a row inserted again with its
// version reset comes back above that tombstone (upsertTail) instead of
// being refused below it for good, as the drain of captured deletes does
// (deletes.go). Such a row is probed once per full run until then, like a
// live row. It returns the candidates read, the last candidate's id and
// the tombstones written (the rows only marked vanished are not counted).
//
// The plan is pinned to the chunk's size, not the table's: gone is
// materialized and probes the source one candidate at a time (a LATERAL
// with LIMIT 1 is never turned into a hash anti-join over the whole
// source), and the tombstone update reads normalized_records only between
// the chunk's first and last vanished ids. Inlined, the planner joined the
// candidates to all of normalized_records with a hash before the
// anti-join: a sequential scan of the read model per chunk (a 1M-row full
// run took twice as long).
//
// It comes in two, [0] for the first chunk and [1] for the chunks after
// one (after set): "after IS NULL OR source_id > after" in one statement
// has a generic plan, once prepared, that reads normalized_records from
// the source's first id to after for every chunk (as the boundary's did:
// see from).
func (c *compiled) sweepSQL(partitions bool) sweepStmts {
	return sweepStmts{c.sweepChunkSQL(partitions, false), c.sweepChunkSQL(partitions, true)}
}

// sweepStmts is a sweep chunk's pair: the first chunk's, the others'.
type sweepStmts [2]stmt

// after picks the statement of the chunk after cursor (nil: the first).
func (p sweepStmts) after(cursor *string) stmt {
	if cursor == nil {
		return p[0]
	}
	return p[1]
}

func (c *compiled) sweepChunkSQL(partitions, after bool) stmt {
	b := newBuilder()
	// The filter without the single-partition term; partitions listed in
	// the spec bound the scope by the run's partition keys instead.
	filter := *c
	filter.spec.Source.Partition = ""
	scope := filter.scopeWhere(b)
	if p := c.spec.Source.Partition; p != "" && partitions {
		scope += " AND s." + q(p) + " = ANY(" + b.p("pkeys", "text[]") + "::" + c.types[p] + "[])"
	}
	id := c.spec.Source.ID
	var afterTerm string
	if after {
		afterTerm = `AND n.source_id > ` + b.p("after", "text")
	}
	sql := `
WITH cand AS MATERIALIZED (
  SELECT n.source_id, n.source_version, n.deleted FROM normalized_records n
  WHERE n.source = ` + b.p("source", "text") + `
    AND (NOT n.deleted OR NOT n.vanished OR n.processor_version IS DISTINCT FROM ` + b.p("pv", "text") + `)
    ` + afterTerm + `
  ORDER BY n.source_id
  LIMIT ` + b.p("limit", "int") + `
), gone AS MATERIALIZED (
  SELECT cand.source_id, cand.source_version, cand.deleted FROM cand
  LEFT JOIN LATERAL (SELECT true AS hit FROM ` + c.table + ` s WHERE s.` + q(id) + ` = cand.source_id::` + c.types[id] + ` AND ` + scope + ` LIMIT 1) h ON true
  WHERE h.hit IS NULL
), quiet AS (
  UPDATE normalized_records n SET vanished = true, updated_at = now()
  FROM gone
  WHERE n.source = ` + b.p("source", "text") + ` AND n.source_id = gone.source_id
    AND n.source_id BETWEEN (SELECT min(source_id) FROM gone) AND (SELECT max(source_id) FROM gone)
    AND n.source_version = gone.source_version AND gone.deleted AND n.deleted AND NOT n.vanished
    AND n.processor_version = ` + b.p("pv", "text") + `
), up AS (
  UPDATE normalized_records n
  SET document = NULL, deleted = true,
      source_version = CASE WHEN gone.deleted THEN gone.source_version ELSE gone.source_version + 1 END,
      processor_version = ` + b.p("pv", "text") + `, vanished = true, updated_at = now()
  FROM gone
  WHERE n.source = ` + b.p("source", "text") + ` AND n.source_id = gone.source_id
    AND n.source_id BETWEEN (SELECT min(source_id) FROM gone) AND (SELECT max(source_id) FROM gone)
    AND n.source_version = gone.source_version AND n.deleted = gone.deleted
    AND (NOT n.deleted OR n.processor_version IS DISTINCT FROM ` + b.p("pv", "text") + `)
  RETURNING n.source_id, n.source_version, n.document, n.deleted
),
` + c.outboxCTE(b, false) + `
SELECT (SELECT count(*) FROM cand), (SELECT max(source_id) FROM cand), (SELECT count(*) FROM up)`
	return b.stmt(sql)
}

// sweep runs the run's sweep, if it has one that is not over. It returns
// true when there is nothing left to sweep, false when another worker holds
// the sweep or a soft stop ended it at a checkpoint.
func (r *Runner) sweep(soft, hard context.Context) (bool, error) {
	job, run := r.spec.Job, r.runID
	log := r.cfg.Logger.With(slog.String("job", job), slog.String("run", run), slog.String("phase", "sweep"))
	var token string
	var cursor *string
	var attempt int
	for {
		err := r.pool.QueryRow(hard, claimSweepSQL, job, run, r.cfg.WorkerID, r.cfg.LeaseTTL.String()).Scan(&token, &cursor, &attempt)
		if err == nil {
			break
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return false, fmt.Errorf("claim the sweep of %s/%s: %w", job, run, err)
		}
		var state string
		err = r.pool.QueryRow(hard, sweepStateSQL, job, run).Scan(&state)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return true, nil // no sweep (vanished: keep, or a run from before)
		case err != nil:
			return false, fmt.Errorf("sweep of %s/%s: %w", job, run, err)
		case state == "failed":
			return false, fmt.Errorf("sweep of %s/%s failed; rerun to retry it", job, run)
		case state != "running":
			return state == "succeeded" || state == "superseded", nil
		}
		// Another worker holds it; wait in case its lease goes stale.
		select {
		case <-soft.Done():
			return false, nil
		case <-time.After(r.cfg.HeartbeatInterval):
		}
	}
	log.Info("sweep claimed", slog.Int("attempt", attempt), slog.Any("cursor", cursor))

	l := &sweepLease{db: r.pool, job: job, run: run, token: token, ttl: r.cfg.LeaseTTL}
	ctx, cancel := context.WithCancelCause(hard)
	defer cancel(nil)
	defer keepAlive(ctx, cancel, r.cfg.HeartbeatInterval, l, log)()
	cleanup, ccancel := context.WithTimeout(context.WithoutCancel(hard), time.Minute)
	defer ccancel()

	if len(r.c.rels) > 0 {
		stopped, err := r.rebuildRelations(soft, hard, ctx, l, cleanup, token, log)
		if err != nil || stopped {
			return false, err
		}
	}
	if r.spec.Mode != ModeFull || r.spec.Vanished != VanishedDelete {
		// A relation job's incremental run: its sweep phase rebuilds the
		// roots of the related changes only.
		return r.finishSweep(cleanup, l, log, 0, 0)
	}
	var keys []string
	if len(r.spec.Source.Partitions) > 0 {
		if err := r.pool.QueryRow(ctx, sweepPartitionsSQL, job, run).Scan(&keys); err != nil {
			return false, fmt.Errorf("sweep of %s/%s: read partitions: %w", job, run, err)
		}
	}
	st := r.c.sweepSQL(len(r.spec.Source.Partitions) > 0)
	// A sweep chunk does little per row (an index probe of the source):
	// the largest chunk size keeps the transactions few.
	size := r.spec.Chunk.Max
	var swept, deleted int64
	for {
		if soft.Err() != nil {
			if err := l.release(cleanup); err != nil {
				log.Warn("release the sweep lease", slog.String("error", err.Error()))
			}
			log.Info("sweep stopped at the last committed checkpoint", slog.Any("cursor", cursor))
			return false, nil
		}
		var n, dels int64
		var last *string
		err := r.retrySweepChunk(ctx, "sweep", log, func() (err error) {
			n, last, dels, err = r.sweepChunk(ctx, st, token, cursor, keys, size)
			return err
		})
		if err != nil {
			return false, r.sweepChunkFailed(ctx, hard, cleanup, l, "sweep", log, err)
		}
		swept, deleted = swept+n, deleted+dels
		if n > 0 {
			cursor = last
			log.Info("sweep chunk committed", slog.Int64("candidates", n), slog.Int64("deleted", dels), slog.Any("cursor_to", cursor))
		}
		if n < int64(size) {
			break
		}
	}
	return r.finishSweep(cleanup, l, log, swept, deleted)
}

func (r *Runner) finishSweep(cleanup context.Context, l *sweepLease, log *slog.Logger, swept, deleted int64) (bool, error) {
	ok, err := l.finish(cleanup)
	if err != nil {
		return false, fmt.Errorf("finish the sweep of %s/%s: %w", r.spec.Job, r.runID, err)
	}
	if !ok {
		return false, l.lost(cleanup)
	}
	log.Info("sweep succeeded", slog.Int64("candidates", swept), slog.Int64("deleted", deleted))
	return true, nil
}

// retrySweepChunk runs chunk, one chunk of the sweep phase (what: "sweep"
// or "relation"), retrying transient errors with the spec's bounded
// backoff.
func (r *Runner) retrySweepChunk(ctx context.Context, what string, log *slog.Logger, chunk func() error) error {
	expo := backoff.NewExponentialBackOff()
	expo.InitialInterval = time.Duration(r.spec.Errors.InitialBackoff)
	expo.MaxInterval = time.Duration(r.spec.Errors.MaxBackoff)
	expo.MaxElapsedTime = 0
	bo := backoff.WithContext(backoff.WithMaxRetries(expo, uint64(r.spec.Errors.MaxRetries)), ctx)
	op := func() error {
		err := chunk()
		if err != nil && (ctx.Err() != nil || !IsRetryable(err)) {
			return backoff.Permanent(err)
		}
		return err
	}
	notify := func(err error, d time.Duration) {
		if r.cfg.Metrics != nil {
			r.cfg.Metrics.Retries.WithLabelValues(r.spec.Job, reasonSweep).Inc()
		}
		log.Warn(what+" chunk rolled back; retrying", slog.String("error", err.Error()), slog.Duration("backoff", d))
	}
	return backoff.RetryNotify(op, bo, notify)
}

// sweepChunkFailed ends the sweep phase after a chunk failed for good
// (what: "sweep" or "relation rebuild") and returns the error to return: a
// lost lease (another worker's to take, nothing recorded), a hard stop (the
// lease released), or the failure, recorded on the sweep.
func (r *Runner) sweepChunkFailed(ctx, hard, cleanup context.Context, l *sweepLease, what string, log *slog.Logger, err error) error {
	job, run := r.spec.Job, r.runID
	if cause := context.Cause(ctx); cause != nil && errors.Is(cause, ErrLeaseLost) {
		err = cause
	}
	if isIdleTimeout(err) {
		// The server ended the chunk's session because this worker sent
		// nothing for a lease TTL (stopped, starved): the lease is another
		// worker's to take, the sweep is not failed.
		err = fmt.Errorf("%w: the %s of %s/%s: this worker stalled past its lease: %w", ErrLeaseLost, what, job, run, err)
	}
	switch {
	case errors.Is(err, ErrLeaseLost):
		log.Error("sweep lease lost; stopping without writing", slog.String("error", err.Error()))
		return err
	case hard.Err() != nil:
		_ = l.release(cleanup)
		return context.Cause(hard)
	}
	if ferr := l.fail(cleanup, err); ferr != nil {
		log.Error("record sweep failure", slog.String("error", ferr.Error()))
	}
	return fmt.Errorf("%s of %s/%s: %w", what, job, run, err)
}

func (r *Runner) sweepChunk(ctx context.Context, sts sweepStmts, token string, cursor *string, keys []string, size int) (n int64, last *string, deleted int64, err error) {
	st := sts.after(cursor)
	// As a scan chunk's: the span's traceparent goes into the tombstones'
	// events, and the publisher and the indexer continue its trace.
	ctx, span := tracing.Start(ctx, "batch.sweep_chunk")
	defer span.End()
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		return 0, nil, 0, fmt.Errorf("begin sweep chunk: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	// As a scan chunk: bounded lock waits, and a frozen sweeper's session
	// ends a lease TTL after its last statement.
	if _, err := tx.Exec(ctx, sweepSettingsSQL,
		strconv.FormatInt(time.Duration(r.spec.Chunk.LockTimeout).Milliseconds(), 10), strconv.FormatInt(r.cfg.LeaseTTL.Milliseconds(), 10)); err != nil {
		return 0, nil, 0, fmt.Errorf("begin sweep chunk: %w", err)
	}
	a := &args{Source: r.spec.SourceName, After: cursor, Limit: size, PV: r.spec.ProcessorVersion, TP: tracing.Arg(ctx), PKeys: keys}
	if err := tx.QueryRow(ctx, st.sql, st.bind(a)...).Scan(&n, &last, &deleted); err != nil {
		return 0, nil, 0, fmt.Errorf("sweep chunk after %v: %w", cursor, err)
	}
	if n == 0 {
		return 0, nil, 0, nil
	}
	hit(failpointSweepAfterDelete)
	tag, err := tx.Exec(ctx, checkpointSweepSQL, r.spec.Job, r.runID, token, cursor, last, n, deleted)
	if err != nil {
		return 0, nil, 0, fmt.Errorf("write sweep checkpoint: %w", err)
	}
	if tag.RowsAffected() != 1 {
		return 0, nil, 0, fmt.Errorf("%w: the sweep of %s/%s (or its cursor moved)", ErrLeaseLost, r.spec.Job, r.runID)
	}
	hit(failpointSweepAfterCheckpoint)
	if err := tx.Commit(ctx); err != nil {
		return 0, nil, 0, fmt.Errorf("commit sweep chunk: %w", err)
	}
	hit(failpointSweepAfterCommit)
	return n, last, deleted, nil
}

// sweepDone says whether the run has no sweep left to do.
func (r *Runner) sweepDone(ctx context.Context) (bool, error) {
	var state string
	err := r.pool.QueryRow(ctx, sweepStateSQL, r.spec.Job, r.runID).Scan(&state)
	if errors.Is(err, pgx.ErrNoRows) {
		return true, nil
	}
	return state == "succeeded" || state == "superseded", err
}

// SweepStatus is the sweep of a full run, as `batcher status` shows it.
type SweepStatus struct {
	Job, RunID, State string
	// Cursor is the last normalized_records.source_id swept (nil: none).
	Cursor *string
	// Swept counts the rows checked (live rows, and soft-deleted ones not
	// yet marked vanished), Deleted the tombstones written.
	Swept, Deleted int64
	// Rebuilt counts the roots a relation job's sweep phase rebuilt for
	// related changes, RebuiltChanged those whose document changed.
	Rebuilt, RebuiltChanged int64
	Attempt                 int
	LeaseOwner              *string
	Error                   *string
	CheckpointAt            *time.Time
	FinishedAt              *time.Time
}

// Sweeps lists the sweeps of the newest runs (at most runs per job; job ""
// = every job), newest first.
func Sweeps(ctx context.Context, db DB, job string, runs int) ([]SweepStatus, error) {
	rows, err := db.Query(ctx, sweepStatusSQL, job, runs)
	if err != nil {
		return nil, fmt.Errorf("read sweeps: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (SweepStatus, error) {
		var s SweepStatus
		err := r.Scan(&s.Job, &s.RunID, &s.State, &s.Cursor, &s.Swept, &s.Deleted, &s.Rebuilt, &s.RebuiltChanged, &s.Attempt, &s.LeaseOwner, &s.Error, &s.CheckpointAt, &s.FinishedAt)
		return s, err
	})
}

// rowScope is what decides which rows of normalized_records a job's sweep
// treats as its own: the table, the id column, the filter and an explicit
// partition list.
func rowScope(s Spec) string {
	sc := s.Scope()
	for i := range sc.Filter { // "in" is a set
		sc.Filter[i].Values = slices.Sorted(slices.Values(sc.Filter[i].Values))
	}
	p := slices.Clone(s.Source.Partitions)
	slices.Sort(p)
	b, _ := json.Marshal(struct {
		Schema, Table, ID string
		Filter            []Condition
		Partitions        []string
	}{sc.Schema, sc.Table, sc.ID, sc.Filter, p})
	return string(b)
}

// checkSharedSourceName refuses a job that shares its source name with
// another job (as batch_jobs last saw it) over a different scope when
// either of the two sweeps (vanished: delete): the sweep treats every live
// row of the source name as its job's, so it would delete the other job's
// rows. It runs under the job lock, before the spec is saved.
func checkSharedSourceName(ctx context.Context, tx pgx.Tx, s Spec) error {
	rows, err := tx.Query(ctx, otherJobsSQL, s.Job)
	if err != nil {
		return fmt.Errorf("read the other jobs' specs: %w", err)
	}
	others, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Spec, error) {
		var job string
		var raw []byte
		if err := row.Scan(&job, &raw); err != nil {
			return Spec{}, err
		}
		var o Spec
		if err := json.Unmarshal(raw, &o); err != nil {
			return Spec{}, fmt.Errorf("stored spec of job %s: %w", job, err)
		}
		o.Job = job
		return o, nil
	})
	if err != nil {
		return fmt.Errorf("read the other jobs' specs: %w", err)
	}
	mine := rowScope(s)
	for _, o := range others {
		name := cmp.Or(o.SourceName, o.Source.Table)
		if name != s.SourceName {
			continue
		}
		if err := checkSameEvents(s, o); err != nil {
			return err
		}
		if s.Document.HasRelations() || o.Document.HasRelations() {
			// Rebuilds of one document must not overlap (relations.go):
			// one job's runs never do, two jobs' could, and a stale
			// rebuild would then be written above a newer one.
			return fmt.Errorf("%w: spec %s: source_name %q is also written by job %s, and a job whose documents join related tables must be the only writer of its source name "+
				"(two jobs could rebuild one document at once, and the older rebuild would win): give one of the jobs its own source_name "+
				"(a retired job: DELETE FROM batch_jobs WHERE job = '%s')",
				ErrSpec, s.Job, s.SourceName, o.Job, o.Job)
		}
		if rowScope(o) == mine {
			continue
		}
		if s.Vanished != VanishedDelete && o.Vanished != VanishedDelete {
			continue
		}
		return fmt.Errorf("%w: spec %s: source_name %q is also written by job %s over another scope (table, filter or partitions), "+
			"and the sweep of a full run (vanished: delete) deletes every live row of its source name that is not in its own scope: "+
			"give one of the jobs its own source_name, or set vanished: keep on both (a retired job: DELETE FROM batch_jobs WHERE job = '%s')",
			ErrSpec, s.Job, s.SourceName, o.Job, o.Job)
	}
	return nil
}

// checkSameEvents refuses a job that shares its source name with job o
// but sends its events to another topic or with another aggregate type.
// normalized_records is keyed by (source, source_id), and a row is written
// (and its event enqueued) only when its source or processor version
// changed: the second job would find every row the first one normalized
// unchanged and send nothing to its topic.
func checkSameEvents(s, o Spec) error {
	topic, aggType := cmp.Or(o.Topic, defaultTopic), cmp.Or(o.AggregateType, o.Source.Table)
	if topic == s.Topic && aggType == s.AggregateType {
		return nil
	}
	return fmt.Errorf("%w: spec %s: source_name %q is also written by job %s, which sends its events to topic %q as aggregate type %q "+
		"(this spec: topic %q, aggregate type %q); normalized rows are keyed by source_name and id, so this job would find every row "+
		"job %s normalized unchanged and send no event: give this job its own source_name (e.g. source_name: %s.%s)",
		ErrSpec, s.Job, s.SourceName, o.Job, topic, aggType, s.Topic, s.AggregateType, o.Job, s.SourceName, s.Job)
}
