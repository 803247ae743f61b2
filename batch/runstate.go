package batch

import (
	"context"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// runStatesSQL counts, for every job, the partitions in each unfinished
// state over all its runs, and the succeeded partitions of its newest run,
// with a zero for each state a job has none in (so a series exists before
// the first failure). Superseded runs were replaced by a new run and are
// left out. Each count reads an index (batch_runs_unfinished, or the
// primary key for the newest run), so a scrape does not grow with the
// history a --follow job piles up.
const runStatesSQL = `
SELECT j.job, s.state,
       CASE WHEN s.state = 'succeeded' THEN
           (SELECT count(*) FROM batch_runs r
            WHERE r.job = j.job AND r.state = 'succeeded'
              AND r.logical_run_id = (SELECT l.logical_run_id FROM batch_runs l WHERE l.job = j.job ORDER BY l.created_at DESC LIMIT 1))
       ELSE
           (SELECT count(*) FROM batch_runs r
            WHERE r.job = j.job AND r.state = s.state AND r.state IN ('pending', 'running', 'paused', 'failed'))
       END
FROM batch_jobs j
CROSS JOIN unnest(ARRAY['pending', 'running', 'paused', 'failed', 'succeeded']) AS s(state)`

// runStalledSQL: per job, the seconds since the longest-stalled of its
// running partitions and sweeps last showed a sign of life, counting only
// those whose lease holder is gone: a lease token is still set (a holder
// that stops softly clears it) and the lease has expired. A sign of life
// is the later of the lease's expiry and the last checkpoint. A killed
// batcher leaves its partitions so, and nothing else moves them on until a
// batcher runs the job again. A live holder's slow chunk is not counted
// here (that is batch_checkpoint_age_seconds, which the running batcher
// exports). 0 for a job with nothing stalled, so the series is there
// before the first crash.
const runStalledSQL = `
SELECT j.job, greatest(0, coalesce(extract(epoch FROM max(now() - s.since))::float8, 0))
FROM batch_jobs j
LEFT JOIN (
    SELECT job, greatest(lease_expires_at, checkpoint_at) AS since
    FROM batch_runs WHERE state = 'running' AND lease_token IS NOT NULL AND lease_expires_at < now()
    UNION ALL
    SELECT job, greatest(lease_expires_at, checkpoint_at)
    FROM batch_sweeps WHERE state = 'running' AND lease_token IS NOT NULL AND lease_expires_at < now()
) s ON s.job = j.job
GROUP BY j.job`

// runStatesTimeout bounds the queries of one scrape.
const runStatesTimeout = 5 * time.Second

// RunStates exports, read from the batch_runs table at every scrape,
// batch_runs{job,state}: how many partitions of the job's runs are in each
// state, and batch_run_stalled_seconds{job}: how long the job's run has had
// a running partition (or sweep) without a live lease holder and without a
// checkpoint. A batcher exits when its run ends, failed or not, or when it
// is killed, and its own metrics end with it; a long-running process that
// reaches the same database (the publisher registers this) keeps the
// record visible, so an alert can fire on a failed or abandoned run after
// its batcher is gone.
type RunStates struct {
	db      DB
	log     *slog.Logger
	desc    *prometheus.Desc
	stalled *prometheus.Desc
}

// NewRunStates returns the collector of batch_runs{job,state} and
// batch_run_stalled_seconds{job} over db.
func NewRunStates(db DB, log *slog.Logger) *RunStates {
	if log == nil {
		log = slog.Default()
	}
	return &RunStates{db: db, log: log,
		desc: prometheus.NewDesc("batch_runs",
			"Partitions of each batch job's runs per state, read from the batch_runs table at each scrape: pending, running, paused and failed over all its runs (failed stays until the run is retried or restarted), succeeded in its newest run.",
			[]string{"job", "state"}, nil),
		stalled: prometheus.NewDesc("batch_run_stalled_seconds",
			"Seconds since the job's longest-stalled running partition or sweep lost its lease holder (the later of its lease expiry and its last checkpoint), with nobody taking it over: its batcher was killed or cut off; read from batch_runs and batch_sweeps at each scrape; 0 while every running partition has a live holder.",
			[]string{"job"}, nil),
	}
}

// Describe implements [prometheus.Collector].
func (c *RunStates) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.desc
	ch <- c.stalled
}

// Collect implements [prometheus.Collector]. When the database does not
// answer it reports nothing (the publisher's own readiness says why).
func (c *RunStates) Collect(ch chan<- prometheus.Metric) {
	if c.db == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), runStatesTimeout)
	defer cancel()
	if err := c.collectStates(ctx, ch); err != nil {
		c.log.Warn("read batch run states for batch_runs", slog.Any("error", err))
	}
	if err := c.collectStalled(ctx, ch); err != nil {
		c.log.Warn("read stalled batch runs for batch_run_stalled_seconds", slog.Any("error", err))
	}
}

func (c *RunStates) collectStates(ctx context.Context, ch chan<- prometheus.Metric) error {
	rows, err := c.db.Query(ctx, runStatesSQL)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var job, state string
		var n int64
		if err := rows.Scan(&job, &state, &n); err != nil {
			return err
		}
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n), job, state)
	}
	return rows.Err()
}

func (c *RunStates) collectStalled(ctx context.Context, ch chan<- prometheus.Metric) error {
	rows, err := c.db.Query(ctx, runStalledSQL)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var job string
		var seconds float64
		if err := rows.Scan(&job, &seconds); err != nil {
			return err
		}
		ch <- prometheus.MustNewConstMetric(c.stalled, prometheus.GaugeValue, seconds, job)
	}
	return rows.Err()
}
