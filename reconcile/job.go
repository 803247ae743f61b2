package reconcile

import (
	"cmp"
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrUnknownJob: batch_jobs has no spec for the job (it never ran).
var ErrUnknownJob = errors.New("unknown job")

// Job is what reconciliation and the index generation commands need from
// a scan job's stored spec (batch_jobs, the spec its last run used).
type Job struct {
	Name             string `json:"job"`
	ProcessorVersion string `json:"processor_version"`
	SourceName       string `json:"source_name"`
	Topic            string `json:"topic"`
	AggregateType    string `json:"aggregate_type"`
	Source           struct {
		Table string `json:"table"`
	} `json:"source"`
}

// LoadJob reads the stored spec of job.
func LoadJob(ctx context.Context, db *pgxpool.Pool, job string) (Job, error) {
	var j Job
	err := db.QueryRow(ctx, `SELECT spec FROM batch_jobs WHERE job = $1`, job).Scan(&j)
	if errors.Is(err, pgx.ErrNoRows) {
		return j, fmt.Errorf("%w %q: no spec in batch_jobs (the job has never run)", ErrUnknownJob, job)
	}
	if err != nil {
		return j, fmt.Errorf("load spec of job %s: %w", job, err)
	}
	return j.withDefaults(), nil
}

// withDefaults fills what a spec may leave out: the source name and the
// aggregate type default to the source table.
func (j Job) withDefaults() Job {
	j.SourceName = cmp.Or(j.SourceName, j.Source.Table)
	j.AggregateType = cmp.Or(j.AggregateType, j.Source.Table)
	return j
}

// loadJobs reads the stored spec of every job, by name.
func loadJobs(ctx context.Context, db *pgxpool.Pool) ([]Job, error) {
	rows, err := db.Query(ctx, `SELECT spec FROM batch_jobs ORDER BY job`)
	if err != nil {
		return nil, fmt.Errorf("list the jobs: %w", err)
	}
	jobs, err := pgx.CollectRows(rows, pgx.RowTo[Job])
	if err != nil {
		return nil, fmt.Errorf("list the jobs: %w", err)
	}
	for i := range jobs {
		jobs[i] = jobs[i].withDefaults()
	}
	return jobs, nil
}
