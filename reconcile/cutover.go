package reconcile

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"

	"github.com/outboxrelay/outboxrelay/batch"
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
	// AllowUnversioned lets the cutover hide the live generation's
	// documents that carry no processor version and that the new
	// generation lacks (see Readiness.Unversioned).
	AllowUnversioned bool

	auto bool // an AutoCutover round: recorded as an automatic cutover
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
	// Live is the generation the read alias points at now. Unversioned
	// counts its documents (tombstones aside) that carry no processor
	// version and whose id the generation at Index lacks: events enqueued
	// by applications (outbox.Enqueue) go through the write alias, into the
	// live generation only, so a cutover would hide them from searches.
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
	cfg = cfg.WithDefaults()
	var r Readiness
	j, err := LoadJob(ctx, db, job)
	if err != nil {
		return r, err
	}
	r.Job, r.ProcessorVersion = j.Name, j.ProcessorVersion
	cfg = cfg.ForAggregateType(j.AggregateType)
	err = db.QueryRow(ctx, `
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
	client, err := sink.NewClientWith(cfg.URL, cfg.HTTPClient)
	if err != nil {
		return r, err
	}
	if r.Index, err = sink.GenerationTarget(ctx, client, cfg.Alias, j.ProcessorVersion); err != nil {
		return r, err
	}
	exists, err := sink.GenerationExists(ctx, client, r.Index)
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
		if err := sink.Refresh(ctx, client, r.Index); err != nil {
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
	if r.Unversioned, r.Live, err = unversionedOnlyInLive(ctx, client, cfg.Alias, r.Index); err != nil {
		return r, err
	}
	if r.Run != "" && r.Succeeded == r.Partitions {
		if err := checkSource(ctx, db, j, &r); err != nil {
			return r, err
		}
	}
	if r.RowsOtherPV > 0 {
		r.Missing = append(r.Missing, fmt.Sprintf("%d row(s) of normalized_records (source %s) are not at processor version %s yet "+
			"(a run at %s has not reached them, or quarantined them: batcher quarantine list --job %s)", r.RowsOtherPV, j.SourceName, j.ProcessorVersion, j.ProcessorVersion, job))
	}
	return r, nil
}

// CutoverResult says what [Cutover] did.
type CutoverResult struct {
	Readiness
	// From are the indices the read alias left; Already is set when the
	// generation was live before.
	From    []string
	Already bool
}

// Cutover makes the generation of job's current processor version live once
// [CheckGeneration] finds it ready (waiting up to opts.Wait): one _aliases
// call moves the read alias, with its tombstone filter, and the write alias
// to it. The old generation is kept, and recorded as the new one's
// previous generation for [Rollback]. A refusal wraps [sink.ErrUnsafeMove] and
// says what is missing; nothing changed then.
func Cutover(ctx context.Context, cfg sink.Config, opts CutoverOptions) (CutoverResult, error) {
	cfg = cfg.WithDefaults()
	opts.Poll = cmp.Or(opts.Poll, 2*time.Second)
	var res CutoverResult
	if opts.DB == nil || opts.Job == "" {
		return res, &sink.ConfigError{Err: errors.New("CutoverOptions.DB and CutoverOptions.Job are required")}
	}
	j, err := LoadJob(ctx, opts.DB, opts.Job)
	if err != nil {
		return res, err
	}
	cfg = cfg.ForAggregateType(j.AggregateType)
	deadline := time.Now().Add(opts.Wait)
	for {
		r, err := CheckGeneration(ctx, cfg, opts.DB, opts.Job)
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
			return res, fmt.Errorf("%w: cutover of alias %s to %s%s: %s", sink.ErrUnsafeMove, cfg.Alias, r.Index, waited, strings.Join(r.Missing, "; "))
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
	if res.Unversioned > 0 && !opts.AllowUnversioned {
		return res, fmt.Errorf("%w: cutover of alias %s to %s: the live generation %s holds %d document(s) without a processor version "+
			"(events enqueued by an application, not by a batcher job) that %s lacks; after the cutover searches would no longer find them. "+
			"Enqueue them again so they reach %s, or accept losing them from searches with --allow-unversioned",
			sink.ErrUnsafeMove, cfg.Alias, res.Index, res.Live, res.Unversioned, res.Index, res.Index)
	}
	from, err := sink.MoveAliases(ctx, cfg, res.Index)
	res.From, res.Already = from, from == nil && err == nil
	if err == nil {
		err = recordLive(ctx, opts.DB, res.Job, res.ProcessorVersion, opts.auto)
	}
	return res, err
}

// unversionedOnlyInLive counts the documents of alias's live generation
// (tombstones aside) that carry no processor version and whose id index
// lacks. Nothing when index is live already.
func unversionedOnlyInLive(ctx context.Context, client *elastic.Client, alias, index string) (int64, string, error) {
	live, err := sink.AliasTargets(ctx, client, alias)
	if err != nil || len(live) != 1 || live[0] == index {
		return 0, "", err
	}
	q := elastic.NewBoolQuery().MustNot(elastic.NewExistsQuery(sink.FieldPV), elastic.NewTermQuery(sink.FieldDeleted, true))
	scroll := client.Scroll(live[0]).Query(q).Size(1000).FetchSource(false)
	defer func() { _ = scroll.Clear(context.WithoutCancel(ctx)) }()
	var hidden int64
	for {
		page, err := scroll.Do(ctx)
		if errors.Is(err, io.EOF) {
			return hidden, live[0], nil
		}
		if err != nil {
			return 0, live[0], fmt.Errorf("list documents without a processor version in %s: %w", live[0], err)
		}
		ids := make([]string, 0, len(page.Hits.Hits))
		for _, h := range page.Hits.Hits {
			ids = append(ids, h.Id)
		}
		if len(ids) == 0 {
			return hidden, live[0], nil
		}
		found, err := client.Count(index).Query(elastic.NewBoolQuery().Filter(elastic.NewIdsQuery().Ids(ids...)).
			MustNot(elastic.NewTermQuery(sink.FieldDeleted, true))).Do(ctx)
		if err != nil {
			return 0, live[0], fmt.Errorf("count documents of %s: %w", index, err)
		}
		hidden += int64(len(ids)) - found
	}
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
