package reconcile

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
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/sink"
)

// CutoverOptions configure [Cutover].
type CutoverOptions struct {
	// DB holds batch_jobs, batch_runs and normalized_records. Required.
	DB *pgxpool.Pool
	// Job whose current processor version's generation goes live. Required.
	Job string
	// Wait is how long to wait for the generation to become ready; 0 checks
	// once and refuses at once.
	Wait time.Duration
	// Poll is how often the checks run while waiting. Default 2s.
	Poll time.Duration
	// Progress, if set, gets one line per check while waiting.
	Progress io.Writer
	// AllowUnversioned lets the cutover hide the documents that carry no
	// processor version and that the new generation lacks (see
	// Readiness.Unversioned).
	AllowUnversioned bool
	// Force moves even though the readiness checks refuse; the move is
	// logged (Logger, else cfg.Logger) and audited in checkpoint_audit
	// (action cutover-forced or rollback-forced). Documents without a
	// processor version are still governed by AllowUnversioned.
	Force bool
	// HealthTimeout bounds the wait for the target generation's shards
	// (green when the generation it replaces is green, else its primaries);
	// default index.DefaultHealthTimeout.
	HealthTimeout time.Duration
	// Logger gets the line of a forced move; default cfg.Logger.
	Logger *slog.Logger
	// locked: the caller (AutoCutover) holds the alias's cutover lock.
	locked bool
	// beforeMove, if set, runs between the count of documents without a
	// processor version and the alias move (tests: a write in the window).
	beforeMove func()
	// afterMove, if set, runs right after the alias move; its error fails
	// the move as a later step would (tests).
	afterMove func() error
	// auto: an AutoCutover round, recorded as an automatic cutover.
	auto bool
}

// Readiness is where a generation stands against what its job produced.
type Readiness struct {
	Job, ProcessorVersion, Index string
	// Run is the job's latest run at ProcessorVersion; Partitions and
	// Succeeded count its partitions, Unfinished names the others.
	Run                   string
	Partitions, Succeeded int
	Unfinished            string
	// RowsOtherPV counts the source's normalized rows of another
	// processor version.
	RowsOtherPV int64
	// Kept counts the rows of another processor version that a job with
	// vanished: keep holds although they left its scope (deleted from the
	// table, or out of its filter): no run reads them again, so they stay
	// at the version that last read them, and their documents are carried
	// into the generation as they are (the move copies them; RowsOtherPV
	// does not count them).
	Kept int64
	// SourceRows and IndexDocs are the two sides reconcile compared;
	// Drift counts the ids that differ.
	SourceRows, IndexDocs int64
	Drift                 int
	// Behind counts the rows of the job's scope in the source table that
	// normalized_records does not hold at ProcessorVersion as they are now
	// (see [batch.CountBehind]): changed, inserted or deleted after a run
	// read them. Rebuild is the job's first run at ProcessorVersion that
	// succeeded (the generation's rebuild), CatchUp the first run at that
	// version started after Rebuild finished ("" when none). Rows behind
	// with no catch-up are a refusal (the rebuild's scan missed them); after
	// a catch-up they are changes in flight, which writers always make.
	// SourceCompared is false when the source was not compared: while the
	// latest run has not succeeded (the cutover is refused anyway, and the
	// comparison reads the whole scope), or when the stored spec names no
	// source table.
	Behind           batch.Behind
	Rebuild, CatchUp string
	SourceCompared   bool
	// Live is the generation the job's documents were found in before the
	// move. Unversioned counts the documents (tombstones aside) that carry
	// no processor version, that the move took out of searches and whose
	// id the generation at Index lacks (only with AllowUnversioned: else
	// the move is refused): events enqueued by applications
	// (outbox.Enqueue) go through the write alias, into the base generation
	// only.
	Live        string
	Unversioned int64
	// Missing says what stands between the generation and a safe cutover;
	// empty means ready.
	Missing []string
}

// Ready reports whether nothing is missing.
func (r Readiness) Ready() bool { return len(r.Missing) == 0 }

func (r Readiness) String() string {
	s := fmt.Sprintf("job %s, processor version %s, index %s: run %s %d/%d partitions succeeded, %d/%d documents, %d drifted, %d rows of another processor version, %s source rows changed since read",
		r.Job, r.ProcessorVersion, r.Index, cmp.Or(r.Run, "-"), r.Succeeded, r.Partitions, r.IndexDocs, r.SourceRows, r.Drift, r.RowsOtherPV, r.behind())
	if len(r.Missing) > 0 {
		s += "; missing: " + strings.Join(r.Missing, "; ")
	}
	return s
}

// behind is Behind.Total, or "-" when the source was not compared.
func (r Readiness) behind() string {
	if !r.SourceCompared {
		return "-"
	}
	return strconv.FormatInt(r.Behind.Total(), 10)
}

// CheckGeneration checks whether the generation of job's current processor
// version may go live: the job's latest run at that version succeeded in
// every partition, every normalized row of the job's source carries that
// version, the generation index matches normalized_records exactly
// (reconcile, processor version included, no drift), and, when rows of the
// source table changed after a run read them (Readiness.Behind), a run at
// that version started after the rebuild run finished (the catch-up).
func CheckGeneration(ctx context.Context, cfg sink.Config, db *pgxpool.Pool, job string) (Readiness, error) {
	j, err := LoadJob(ctx, db, job)
	if err != nil {
		return Readiness{}, err
	}
	return checkGenerationAt(ctx, cfg, db, j, "")
}

// checkGenerationAt is CheckGeneration of j at j.ProcessorVersion (a
// rollback's target version), for the generation index (when "", the
// version's generation).
func checkGenerationAt(ctx context.Context, cfg sink.Config, db *pgxpool.Pool, j Job, gen string) (Readiness, error) {
	cfg = cfg.WithDefaults()
	var r Readiness
	job := j.Name
	r.Job, r.ProcessorVersion = j.Name, j.ProcessorVersion
	cfg = cfg.ForAggregateType(j.AggregateType)
	err := db.QueryRow(ctx, `
SELECT logical_run_id, count(*), count(*) FILTER (WHERE state = 'succeeded'),
       coalesce(string_agg(CASE WHEN partition_key = '' THEN '(all)' ELSE partition_key END || ' ' || state, ', ' ORDER BY partition_key) FILTER (WHERE state <> 'succeeded'), '')
FROM batch_runs WHERE job = $1 AND processor_version = $2 AND state <> 'superseded'
GROUP BY logical_run_id ORDER BY max(created_at) DESC LIMIT 1`, job, j.ProcessorVersion).Scan(&r.Run, &r.Partitions, &r.Succeeded, &r.Unfinished)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		r.Missing = append(r.Missing, fmt.Sprintf("no run of job %s at processor version %s (batcher run --job %s)", job, j.ProcessorVersion, job))
	case err != nil:
		return r, fmt.Errorf("load runs of job %s: %w", job, err)
	case r.Succeeded < r.Partitions:
		r.Missing = append(r.Missing, fmt.Sprintf("run %s has not succeeded in every partition (%s)", r.Run, r.Unfinished))
	}
	client, err := index.NewClientWith(cfg.URL, cfg.HTTPClient)
	if err != nil {
		return r, err
	}
	if r.Index = gen; r.Index == "" {
		if r.Index, err = index.GenerationTarget(ctx, client, cfg.Alias, j.ProcessorVersion); err != nil {
			return r, err
		}
	}
	exists, err := index.GenerationExists(ctx, client, r.Index)
	if err != nil {
		return r, err
	}
	rc := Config{DB: db, Search: client, Index: r.Index, Source: j.SourceName, AggregateType: j.AggregateType, ProcessorVersion: j.ProcessorVersion, Limit: 1}
	if !exists {
		r.Missing = append(r.Missing, fmt.Sprintf("index %s does not exist yet (no indexer has seen an event of processor version %s)", r.Index, j.ProcessorVersion))
		// The rows still count, for the progress line.
		if err := db.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE processor_version IS DISTINCT FROM $2) FROM normalized_records WHERE source = $1`,
			j.SourceName, j.ProcessorVersion).Scan(&r.SourceRows, &r.RowsOtherPV); err != nil {
			return r, fmt.Errorf("count normalized rows of %s: %w", j.SourceName, err)
		}
	} else {
		if err := index.Refresh(ctx, client, r.Index); err != nil {
			return r, err
		}
		rep, err := Run(ctx, rc)
		if err != nil {
			return r, err
		}
		r.SourceRows, r.IndexDocs, r.RowsOtherPV = rep.SourceRows, rep.IndexDocs, rep.SourceRowsOtherPV
		r.Drift = rep.MissingCount + rep.StaleCount + rep.ExtraCount
		if r.Drift > 0 {
			r.Missing = append(r.Missing, fmt.Sprintf("index %s differs from normalized_records in %d id(s) (%d missing, %d stale, %d extra; events in flight, or see indexer reconcile --job %s)",
				r.Index, r.Drift, rep.MissingCount, rep.StaleCount, rep.ExtraCount, job))
		}
	}
	if r.Run != "" && r.Succeeded == r.Partitions {
		if err := checkSource(ctx, db, j, &r); err != nil {
			return r, err
		}
	}
	if r.RowsOtherPV > 0 {
		kept, err := keptRows(ctx, db, j)
		if err != nil {
			return r, err
		}
		r.Kept = int64(len(kept))
		r.RowsOtherPV -= r.Kept
	}
	if err := checkOtherJobs(ctx, db, j, &r); err != nil {
		return r, err
	}
	if r.RowsOtherPV > 0 {
		r.Missing = append(r.Missing, fmt.Sprintf("%d row(s) of normalized_records (source %s) are not at processor version %s yet "+
			"(a run at %s has not reached them, or quarantined them: batcher quarantine list --job %s)", r.RowsOtherPV, j.SourceName, j.ProcessorVersion, j.ProcessorVersion, job))
	}
	return r, nil
}

// CutoverResult says what [Cutover] and [Rollback] did.
type CutoverResult struct {
	Readiness
	// From are the generations the job's documents left (empty: from
	// none); Already is set when the generation was live for the job
	// before. Whole: the write alias moved too (every job of the alias is
	// live in the generation now). Forced: the checks refused and Force
	// moved anyway. Copied counts documents without a processor version
	// written into the generation left during the move and copied over.
	Alias   string
	From    []string
	Already bool
	Whole   bool
	Forced  bool
	Copied  int64
}

// Cutover makes the generation of job's current processor version live for
// the job's documents once [CheckGeneration] finds it ready (waiting up to
// opts.Wait): one _aliases call rewrites the read alias so searches find
// the job's documents there and every other job's where they were (see
// index.PlanMove); when every job of the alias is then live there, the
// write alias moves too. The generation left is kept and recorded as the
// job's previous generation for [Rollback]. A refusal wraps
// [index.ErrUnsafeMove] and says what is missing; nothing changed then.
func Cutover(ctx context.Context, cfg sink.Config, opts CutoverOptions) (CutoverResult, error) {
	if opts.DB == nil || opts.Job == "" {
		return CutoverResult{}, &sink.ConfigError{Err: errors.New("CutoverOptions.DB and CutoverOptions.Job are required")}
	}
	j, err := LoadJob(ctx, opts.DB, opts.Job)
	if err != nil {
		return CutoverResult{}, err
	}
	return moveChecked(ctx, cfg, opts, j, "", "cutover")
}

// moveChecked waits for j's generation at j.ProcessorVersion (index, or
// that version's generation when "") to pass the checks, then moves j's
// documents there. what names the command in messages and the audit.
func moveChecked(ctx context.Context, cfg sink.Config, opts CutoverOptions, j Job, gen, what string) (CutoverResult, error) {
	cfg = cfg.WithDefaults()
	opts.Poll = cmp.Or(opts.Poll, 2*time.Second)
	var res CutoverResult
	cfg = cfg.ForAggregateType(j.AggregateType)
	deadline := time.Now().Add(opts.Wait)
	var forced string // the refusal --force moved past
	client, err := index.NewClientWith(cfg.URL, cfg.HTTPClient)
	if err != nil {
		return res, err
	}
	if gen == "" {
		if gen, err = index.GenerationTarget(ctx, client, cfg.Alias, j.ProcessorVersion); err != nil {
			return res, err
		}
	}
	for {
		if err := carryKept(ctx, cfg, opts.DB, client, j, gen); err != nil {
			return res, err
		}
		r, err := checkGenerationAt(ctx, cfg, opts.DB, j, gen)
		res.Readiness = r
		if err != nil {
			return res, err
		}
		if r.Ready() {
			break
		}
		if opts.Wait <= 0 || time.Now().After(deadline) {
			waited := ""
			if opts.Wait > 0 {
				waited = fmt.Sprintf(" after waiting %s", opts.Wait)
			}
			refusal := fmt.Sprintf("%s of job %s (alias %s) to %s%s: %s", what, j.Name, cfg.Alias, r.Index, waited, strings.Join(r.Missing, "; "))
			if !opts.Force {
				return res, fmt.Errorf("%w: %s (--force moves anyway)", index.ErrUnsafeMove, refusal)
			}
			// Audited and logged once the aliases moved: the move can
			// still refuse (documents without a processor version, the
			// health wait, the _aliases call).
			forced = refusal
			res.Forced = true
			break
		}
		if opts.Progress != nil {
			fmt.Fprintf(opts.Progress, "waiting: %d/%d documents in %s, %d drifted, %d rows to rebuild, %s source rows changed since read, run %s %d/%d partitions\n",
				r.IndexDocs, r.SourceRows, r.Index, r.Drift, r.RowsOtherPV, r.behind(), cmp.Or(r.Run, "-"), r.Succeeded, r.Partitions)
		}
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-time.After(opts.Poll):
		}
	}
	res.Alias = cfg.Alias
	mr, err := moveJob(ctx, cfg, opts.DB, client, j, res.Index, opts)
	res.Live, res.Unversioned, res.Copied = mr.Plan.From, mr.Hidden, mr.Copied
	res.From, res.Already, res.Whole = mr.From, mr.Already, mr.Plan.Whole
	if mr.Moved || err == nil {
		// Searches read the generation now, even when a step after the
		// _aliases call failed: record it as live.
		// The version the documents left is recorded as having been live
		// (unknown: none; a failed lookup must not keep the move unrecorded).
		left, lerr := leftVersion(ctx, opts.DB, client, cfg.Alias, cfg.WriteAlias, res.Job, mr.Plan.From)
		if lerr != nil {
			cmp.Or(opts.Logger, cfg.Logger).Warn("the processor version the documents left is unknown; not recorded as having been live",
				slog.String("job", j.Name), slog.String("from", mr.Plan.From), slog.String("error", lerr.Error()))
		}
		err = errors.Join(err, recordLive(ctx, opts.DB, res.Job, res.ProcessorVersion, moveKind(what, opts.auto), left))
	}
	if mr.Moved && res.Forced {
		cmp.Or(opts.Logger, cfg.Logger).Warn(what+" forced past the checks (--force)", slog.String("job", j.Name), slog.String("alias", cfg.Alias),
			slog.String("index", res.Index), slog.String("refused", strings.Join(res.Missing, "; ")))
		err = errors.Join(err, auditForced(context.WithoutCancel(ctx), opts.DB, j.Name, what, "--force past: "+forced))
	}
	return res, err
}

// moveJob moves job j's documents (aggregate type) to target, in cfg's
// alias (cfg routed already), with index.MoveJob, under the alias's cutover
// lock (taken here unless the caller holds it). The caller ran the
// readiness checks.
func moveJob(ctx context.Context, cfg sink.Config, db *pgxpool.Pool, client *elastic.Client, j Job, target string, opts CutoverOptions) (index.MoveResult, error) {
	if !opts.locked {
		unlock, err := index.LockAlias(ctx, db, cfg.Alias)
		if err != nil {
			return index.MoveResult{}, err
		}
		defer unlock()
	}
	types, err := jobTypesOf(ctx, db, cfg, cfg.Alias)
	if err != nil {
		return index.MoveResult{}, err
	}
	return index.MoveJob(ctx, client, db, cfg.Alias, cfg.WriteAlias,
		index.JobMove{Type: j.AggregateType, Target: target, JobTypes: types, HealthTimeout: opts.HealthTimeout},
		index.MoveOptions{Job: j.Name, AllowUnversioned: opts.AllowUnversioned, Locked: true, BeforeMove: opts.beforeMove, AfterMove: opts.afterMove, Logger: cfg.Logger})
}

// Rollback moves job's documents back to the generation they were live in
// before they last moved to the one they are live in now (so rolling back
// twice rolls forward again), after the same checks as [Cutover], made at
// that generation's processor version: its latest run succeeded, every
// normalized row of the source is at that version (after a cutover rows
// move on to the new version: run the job at the old one first, e.g.
// batcher run --spec job-v1.yaml), the generation matches
// normalized_records, and no document without a processor version is
// hidden. opts.Force moves past the checks (logged and audited). It
// refuses when no previous generation is recorded, or it was dropped (or
// dropped and created again since).
func Rollback(ctx context.Context, cfg sink.Config, opts CutoverOptions) (CutoverResult, error) {
	if opts.DB == nil || opts.Job == "" {
		return CutoverResult{}, &sink.ConfigError{Err: errors.New("CutoverOptions.DB and CutoverOptions.Job are required")}
	}
	j, err := LoadJob(ctx, opts.DB, opts.Job)
	if err != nil {
		return CutoverResult{}, err
	}
	cfg = cfg.WithDefaults().ForAggregateType(j.AggregateType)
	var res CutoverResult
	res.Job = j.Name
	client, err := index.NewClientWith(cfg.URL, cfg.HTTPClient)
	if err != nil {
		return res, err
	}
	g, err := index.RollbackTarget(ctx, client, cfg.Alias, cfg.WriteAlias, j.Name, j.AggregateType)
	if err != nil {
		return res, err
	}
	prev := g.Index
	j.ProcessorVersion = g.Meta.ProcessorVersion
	if j.ProcessorVersion == "" {
		// A generation without metadata (the index the indexer created at
		// its start, never adopted): the version of the job's runs whose
		// generation name it has.
		rows, err := opts.DB.Query(ctx, `SELECT DISTINCT processor_version FROM batch_runs WHERE job = $1`, j.Name)
		if err != nil {
			return res, fmt.Errorf("list the processor versions of job %s: %w", j.Name, err)
		}
		pvs, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return res, fmt.Errorf("list the processor versions of job %s: %w", j.Name, err)
		}
		for _, pv := range pvs {
			if index.GenerationIndex(cfg.Alias, pv) == prev {
				j.ProcessorVersion = pv
			}
		}
		if j.ProcessorVersion == "" {
			// Neither checked nor recorded as live without a version,
			// --force or not.
			return res, fmt.Errorf("%w: rollback of job %s to %s: its processor version is unknown (the generation records none in its _meta "+
				"and no run of the job in batch_runs has that generation's name); move the aliases by hand if it must go live",
				index.ErrUnsafeMove, j.Name, prev)
		}
	}
	return moveChecked(ctx, cfg, opts, j, prev, "rollback")
}

// keptRows returns the ids of the rows of j's source at another processor
// version than j.ProcessorVersion that its scope no longer holds, when the
// job keeps vanished rows (vanished: keep, the default of incremental
// jobs); nil otherwise.
func keptRows(ctx context.Context, db *pgxpool.Pool, j Job) ([]string, error) {
	if j.Source.Table == "" {
		return nil, nil
	}
	spec, err := batch.LoadJobSpec(ctx, db, j.Name)
	if err != nil {
		return nil, err
	}
	vanished := spec.Vanished
	if vanished == "" {
		vanished = batch.VanishedDelete
		if spec.Mode == batch.ModeIncremental {
			vanished = batch.VanishedKeep
		}
	}
	if vanished != batch.VanishedKeep {
		return nil, nil
	}
	sr, err := batch.CompileScopeRows(ctx, db, spec)
	if err != nil {
		return nil, err
	}
	n := len(sr.Args)
	rows, err := db.Query(ctx, fmt.Sprintf(`SELECT n.source_id FROM normalized_records n
WHERE n.source = $%d AND n.processor_version IS DISTINCT FROM $%d
  AND NOT EXISTS (SELECT FROM (%s) s WHERE s.id = n.source_id)`, n+1, n+2, sr.SQL), append(slices.Clone(sr.Args), j.SourceName, j.ProcessorVersion)...)
	if err != nil {
		return nil, fmt.Errorf("list the kept rows of job %s: %w", j.Name, err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("list the kept rows of job %s: %w", j.Name, err)
	}
	return ids, nil
}

// carryKept copies the documents of j's kept rows (see [keptRows]) from the
// generation they are live in into index, at their external version, so
// searches go on finding them after the move.
func carryKept(ctx context.Context, cfg sink.Config, db *pgxpool.Pool, client *elastic.Client, j Job, gen string) error {
	ids, err := keptRows(ctx, db, j)
	if err != nil || len(ids) == 0 {
		return err
	}
	state, err := index.ReadAliasState(ctx, client, cfg.Alias, cfg.WriteAlias)
	if err != nil {
		return err
	}
	from := state.LiveOf(j.AggregateType)
	if from == "" || from == gen {
		return nil
	}
	if ok, err := index.GenerationExists(ctx, client, gen); err != nil || !ok {
		return err
	}
	return index.CopyDocs(ctx, client, from, gen, ids)
}

// rebuildRunsSQL finds job $1's rebuild at processor version $2 (its first
// run at that version that succeeded in every partition) and the first run
// at that version created after the rebuild finished (its partitions and
// its sweep), "" when there is none.
const rebuildRunsSQL = `
WITH runs AS (
  SELECT r.logical_run_id, min(r.created_at) AS created, bool_and(r.state = 'succeeded') AS ok,
         coalesce(greatest(max(r.finished_at), (SELECT w.finished_at FROM batch_sweeps w WHERE w.job = $1 AND w.logical_run_id = r.logical_run_id)),
                  min(r.created_at)) AS finished
  FROM batch_runs r WHERE r.job = $1 AND r.processor_version = $2 AND r.state <> 'superseded'
  GROUP BY r.logical_run_id
), rebuild AS (SELECT * FROM runs WHERE ok ORDER BY created, logical_run_id LIMIT 1)
SELECT rebuild.logical_run_id,
       coalesce((SELECT c.logical_run_id FROM runs c WHERE c.created > rebuild.finished ORDER BY c.created LIMIT 1), '')
FROM rebuild`

// checkSource counts the rows of the job's scope that changed after a run
// read them and refuses when the rebuild was not followed by a catch-up.
// A stored spec without a source table (not one the batcher wrote) has
// nothing to compare.
func checkSource(ctx context.Context, db *pgxpool.Pool, j Job, r *Readiness) error {
	if j.Source.Table == "" {
		return nil
	}
	spec, err := batch.LoadJobSpec(ctx, db, j.Name)
	if err != nil {
		return err
	}
	spec.ProcessorVersion = j.ProcessorVersion // a rollback checks the version it goes back to
	if r.Behind, err = batch.CountBehind(ctx, db, spec); err != nil {
		return err
	}
	r.SourceCompared = true
	err = db.QueryRow(ctx, rebuildRunsSQL, j.Name, j.ProcessorVersion).Scan(&r.Rebuild, &r.CatchUp)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("find the rebuild run of job %s: %w", j.Name, err)
	}
	if r.Behind.Total() > 0 && r.Rebuild != "" && r.CatchUp == "" {
		r.Missing = append(r.Missing, fmt.Sprintf("%d row(s) of %s.%s changed after run %s read them (%d updated or soft-deleted, %d new in the scope, %d gone from it); "+
			"run the job again (batcher run --spec with the job's spec, or batcher run --job %s: the catch-up) and cut over after it",
			r.Behind.Total(), spec.Source.Schema, spec.Source.Table, r.Rebuild, r.Behind.Changed, r.Behind.Missing, r.Behind.Gone, j.Name))
	}
	return nil
}

// checkOtherJobs adds to r.Missing every other job of batch_jobs whose
// documents have j's aggregate type (so go to the same alias) and that
// runs at another processor version: the move is by aggregate type, so
// its documents would move too, into a generation its runs do not write.
func checkOtherJobs(ctx context.Context, db *pgxpool.Pool, j Job, r *Readiness) error {
	jobs, err := loadJobs(ctx, db)
	if err != nil {
		return err
	}
	for _, k := range jobs {
		if k.Name == j.Name || k.AggregateType != j.AggregateType || k.ProcessorVersion == j.ProcessorVersion {
			continue
		}
		r.Missing = append(r.Missing, fmt.Sprintf("job %s writes documents of aggregate type %s too, at processor version %s: they would move with this one's "+
			"into a generation its runs do not write; run job %s at processor version %s first (or, if it no longer runs, delete its row from batch_jobs)",
			k.Name, j.AggregateType, k.ProcessorVersion, k.Name, j.ProcessorVersion))
	}
	return nil
}

// jobTypesOf returns the aggregate types of every job in batch_jobs whose
// documents go to alias under cfg's routes.
func jobTypesOf(ctx context.Context, db *pgxpool.Pool, cfg sink.Config, alias string) ([]string, error) {
	jobs, err := loadJobs(ctx, db)
	if err != nil {
		return nil, fmt.Errorf("the jobs of alias %s: %w", alias, err)
	}
	var out []string
	for _, j := range jobs {
		if cfg.Unrouted().ForAggregateType(j.AggregateType).Alias == alias {
			out = append(out, j.AggregateType)
		}
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// auditForced records a move made with --force past refused checks, in
// checkpoint_audit (action "<what>-forced").
func auditForced(ctx context.Context, db *pgxpool.Pool, job, what, reason string) error {
	actor := cmp.Or(os.Getenv("USER"), "indexer")
	if _, err := db.Exec(ctx, `INSERT INTO checkpoint_audit (job, logical_run_id, partition_key, actor, reason, action) VALUES ($1, '', '', $2, $3, $4)`,
		job, actor, reason, what+"-forced"); err != nil {
		return fmt.Errorf("audit the forced %s of job %s: %w", what, job, err)
	}
	return nil
}
