package reconcile

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/index"
)

// The live processor version of each job is recorded in PostgreSQL
// (batch_processor_versions, see [batch.SetLiveVersion]) whenever the
// aliases move: by [Cutover], [AutoCutover] and [Rollback]. The
// batcher refuses a run at a version that was live before and is not now,
// and reconcile --job compares the live version.

// moveKind is how a move of what ("cutover" or "rollback") is recorded
// in batch_live_version_moves.
func moveKind(what string, auto bool) string {
	switch {
	case what == "rollback":
		return batch.MovedByRollback
	case auto:
		return batch.MovedByAutoCutover
	}
	return batch.MovedByCutover
}

// recordLive records pv as job's live processor version after a cutover
// or rollback (how: [moveKind]) moved the job's documents to its
// generation; left is the version of the generation they left ("":
// unknown), recorded as having been live (a job upgraded since migration
// 016 may have none recorded yet), so a run at it is refused afterwards.
func recordLive(ctx context.Context, db *pgxpool.Pool, job, pv, how, left string) error {
	// The aliases moved: record it even when ctx ended meanwhile.
	if _, err := batch.SetLiveVersion(context.WithoutCancel(ctx), db, job, pv, how, left); err != nil {
		return fmt.Errorf("the documents of job %s moved to processor version %s, but recording it as live failed "+
			"(batcher runs at %s may be refused until it is: run indexer cutover --job %s again): %w", job, pv, pv, job, err)
	}
	return nil
}

// leftVersion is the processor version of generation from, where job's
// documents were live before a move: its _meta's, else the version of the
// job's whose generation name it is (the bootstrap <alias>_v1: v1); ""
// when from is "" or none matches.
func leftVersion(ctx context.Context, db *pgxpool.Pool, client *elastic.Client, alias, writeAlias, job, from string) (string, error) {
	if from == "" {
		return "", nil
	}
	gens, err := index.Generations(ctx, client, alias, writeAlias)
	if err != nil {
		return "", err
	}
	for _, g := range gens {
		if g.Index == from && g.Meta.ProcessorVersion != "" {
			return g.Meta.ProcessorVersion, nil
		}
	}
	rows, err := db.Query(ctx, `SELECT processor_version FROM batch_processor_versions WHERE job = $1`, job)
	if err != nil {
		return "", fmt.Errorf("list the processor versions of job %s: %w", job, err)
	}
	pvs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return "", fmt.Errorf("list the processor versions of job %s: %w", job, err)
	}
	for _, pv := range append(pvs, "v1") {
		if index.GenerationIndex(alias, pv) == from {
			return pv, nil
		}
	}
	return "", nil
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
