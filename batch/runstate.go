package batch

import (
	"context"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// runStatesSQL counts the partitions of every job's runs per state, with a
// zero for each state a job has none in (so a series exists before the
// first failure). Superseded runs were replaced by a new run and are left
// out.
const runStatesSQL = `
SELECT j.job, s.state, count(r.job)
FROM (SELECT DISTINCT job FROM batch_runs) j
CROSS JOIN unnest(ARRAY['pending', 'running', 'paused', 'failed', 'succeeded']) AS s(state)
LEFT JOIN batch_runs r ON r.job = j.job AND r.state = s.state
GROUP BY j.job, s.state`

// runStatesTimeout bounds the query of one scrape.
const runStatesTimeout = 5 * time.Second

// RunStates exports batch_runs{job,state}: how many partitions of the
// job's runs are in each state, read from the batch_runs table at every
// scrape. A batcher exits when its run ends, failed or not, and its own
// metrics end with it; a long-running process that reaches the same
// database (the publisher registers this) keeps the record visible, so an
// alert can fire on a failed run after its batcher is gone.
type RunStates struct {
	db   DB
	log  *slog.Logger
	desc *prometheus.Desc
}

// NewRunStates returns the collector of batch_runs{job,state} over db.
func NewRunStates(db DB, log *slog.Logger) *RunStates {
	if log == nil {
		log = slog.Default()
	}
	return &RunStates{db: db, log: log, desc: prometheus.NewDesc("batch_runs",
		"Partitions of each batch job's runs per state (pending, running, paused, failed, succeeded), read from the batch_runs table at each scrape; failed stays until the run is retried or restarted.",
		[]string{"job", "state"}, nil)}
}

// Describe implements [prometheus.Collector].
func (c *RunStates) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

// Collect implements [prometheus.Collector]. When the database does not
// answer it reports nothing (the publisher's own readiness says why).
func (c *RunStates) Collect(ch chan<- prometheus.Metric) {
	if c.db == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), runStatesTimeout)
	defer cancel()
	rows, err := c.db.Query(ctx, runStatesSQL)
	if err != nil {
		c.log.Warn("read batch run states for batch_runs", slog.Any("error", err))
		return
	}
	defer rows.Close()
	for rows.Next() {
		var job, state string
		var n int64
		if err := rows.Scan(&job, &state, &n); err != nil {
			c.log.Warn("read batch run states for batch_runs", slog.Any("error", err))
			return
		}
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n), job, state)
	}
	if err := rows.Err(); err != nil {
		c.log.Warn("read batch run states for batch_runs", slog.Any("error", err))
	}
}
