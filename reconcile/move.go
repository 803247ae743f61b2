package reconcile

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"slices"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/sink"
)

// A job's move (cutover, rollback, roll-forward) is made by package index
// (index.MoveJob), after the readiness checks of cutover.go. What the move
// needs from the jobs' specs is found here.

// jobTypesOf returns the aggregate types of every job in batch_jobs whose
// documents go to alias under cfg's routes.
func jobTypesOf(ctx context.Context, db *pgxpool.Pool, cfg sink.Config, alias string) ([]string, error) {
	rows, err := db.Query(ctx, `SELECT spec FROM batch_jobs`)
	if err != nil {
		return nil, fmt.Errorf("list the jobs of alias %s: %w", alias, err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var j Job
		if err := rows.Scan(&j); err != nil {
			return nil, fmt.Errorf("list the jobs of alias %s: %w", alias, err)
		}
		typ := cmp.Or(j.AggregateType, j.Source.Table)
		if cfg.ForAggregateType(typ).Alias == alias {
			out = append(out, typ)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list the jobs of alias %s: %w", alias, err)
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
