package reconcile

import (
	"cmp"
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/sink"
)

// The live processor version of each job is recorded in PostgreSQL
// (batch_processor_versions, see [batch.SetLiveVersion]) whenever the
// aliases move: by [Cutover], [AutoCutover] and [RecordRollback]. The
// batcher refuses a run at a version that was live before and is not now,
// and reconcile --job compares the live version.

// recordLive records pv as job's live processor version after a cutover
// (auto: an automatic one) moved the aliases to its generation.
func recordLive(ctx context.Context, db *pgxpool.Pool, job, pv string, auto bool) error {
	how := batch.MovedByCutover
	if auto {
		how = batch.MovedByAutoCutover
	}
	// The aliases moved: record it even when ctx ended meanwhile.
	if _, err := batch.SetLiveVersion(context.WithoutCancel(ctx), db, job, pv, how); err != nil {
		return fmt.Errorf("the aliases moved to processor version %s of job %s, but recording it as live failed "+
			"(batcher runs at %s may be refused until it is: run indexer cutover --job %s again): %w", pv, job, pv, job, err)
	}
	return nil
}

// rolledBackFrom reports whether job's processor version pv was live before
// and is not now (recorded in PostgreSQL): an automatic cutover never
// moves back to such a generation, whatever its _meta says (a bootstrap or
// adopted generation records no cutover).
func rolledBackFrom(ctx context.Context, db *pgxpool.Pool, job, pv string) (bool, error) {
	was, err := batch.WasLive(ctx, db, job, pv)
	if err != nil || !was {
		return false, err
	}
	live, err := batch.LoadLiveVersion(ctx, db, job)
	if errors.Is(err, batch.ErrNotFound) {
		return true, nil
	}
	return err == nil && live.ProcessorVersion != pv, err
}

// LiveProcessorVersion is the processor version whose generation searches
// read for job: the one recorded in PostgreSQL, else (nothing recorded
// yet) the stored spec's. reconcile --job compares that generation.
func LiveProcessorVersion(ctx context.Context, db *pgxpool.Pool, j Job) (string, error) {
	live, err := batch.LoadLiveVersion(ctx, db, j.Name)
	if errors.Is(err, batch.ErrNotFound) {
		return j.ProcessorVersion, nil
	}
	return live.ProcessorVersion, err
}

// RecordRollback records, after [sink.Rollback] moved cfg's aliases to
// index, that the processor version of index is live for every job that
// writes cfg's alias (its aggregate type routes there) and ran at that
// version. It returns those jobs.
func RecordRollback(ctx context.Context, cfg sink.Config, db *pgxpool.Pool, index string) ([]string, error) {
	cfg = cfg.WithDefaults()
	client, err := sink.NewClientWith(cfg.URL, cfg.HTTPClient)
	if err != nil {
		return nil, err
	}
	gens, err := sink.Generations(ctx, client, cfg.Alias, cfg.WriteAlias)
	if err != nil {
		return nil, err
	}
	pv := ""
	for _, g := range gens {
		if g.Index == index {
			pv = g.Meta.ProcessorVersion
		}
	}
	if pv == "" && index == cfg.Alias+"_v1" {
		pv = "v1" // the index the indexer creates at its start, before a v1 event adopted it
	}
	if pv == "" {
		return nil, fmt.Errorf("record the live processor version: index %s records no processor version in its _meta", index)
	}
	rows, err := db.Query(ctx, `
SELECT j.spec FROM batch_jobs j
WHERE EXISTS (SELECT FROM batch_processor_versions v WHERE v.job = j.job AND v.processor_version = $1)
ORDER BY j.job`, pv)
	if err != nil {
		return nil, fmt.Errorf("read the jobs of alias %s: %w", cfg.Alias, err)
	}
	jobs, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Job, error) {
		var j Job
		err := row.Scan(&j)
		j.AggregateType = cmp.Or(j.AggregateType, j.Source.Table)
		return j, err
	})
	if err != nil {
		return nil, fmt.Errorf("read the jobs of alias %s: %w", cfg.Alias, err)
	}
	var moved []string
	for _, j := range jobs {
		if cfg.ForAggregateType(j.AggregateType).Alias != cfg.Alias {
			continue
		}
		if _, err := batch.SetLiveVersion(context.WithoutCancel(ctx), db, j.Name, pv, batch.MovedByRollback); err != nil {
			return moved, err
		}
		moved = append(moved, j.Name)
	}
	return moved, nil
}
