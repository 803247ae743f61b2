package batch

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the batcher's Prometheus series (names from seed 002).
type Metrics struct {
	ChunkDuration *prometheus.HistogramVec // batch_chunk_duration_seconds{job,phase}
	ChunkSize     *prometheus.GaugeVec     // batch_chunk_size{job}
	Rows          *prometheus.CounterVec   // batch_rows_processed_total{job,status}
	Inflight      *prometheus.GaugeVec     // batch_items_inflight{job}
	Retries       *prometheus.CounterVec   // batch_retry_total{job,reason}
	RateLimitWait *prometheus.HistogramVec // batch_rate_limit_wait_seconds{job}
	LockWait      *prometheus.HistogramVec // batch_lock_wait_seconds{job}
	// OpenWritersExpired counts the run starts that gave up waiting for
	// open writers of the source table (Config.OpenWritersWait).
	OpenWritersExpired *prometheus.CounterVec // batch_open_writers_wait_expired_total{job}
	// RelationRoots counts a relation job's roots by what became of them:
	// queued (resolved from captured related changes), then changed,
	// unchanged or quarantined by the run's relation phase.
	RelationRoots *prometheus.CounterVec // batch_relation_roots_total{job,status}
	age           *checkpointAge         // batch_checkpoint_age_seconds{job}
	writersWait   *checkpointAge         // batch_open_writers_wait_seconds{job}
}

// NewMetrics registers the series on reg (nil: not registered, still
// usable). batch_checkpoint_age_seconds is read from db (the batch_runs
// table) at each scrape, so it is the same whichever process serves it and
// covers the partitions other processes run; db nil leaves it out.
func NewMetrics(reg prometheus.Registerer, db DB) *Metrics {
	m := &Metrics{
		ChunkDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "batch_chunk_duration_seconds", Help: "Duration of each phase of a chunk: fetch (SQL path: the one select-normalize-upsert-outbox statement; Go path: the read), process (Go path: the processor), commit (Go path: the unnest upsert-outbox statement; both: checkpoint UPDATE and COMMIT), total.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2.5, 14),
		}, []string{"job", "phase"}),
		ChunkSize: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "batch_chunk_size", Help: "Chunk size in use (rows)."}, []string{"job"}),
		Rows: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "batch_rows_processed_total", Help: "Source rows committed, by status: changed (new event), unchanged (same version, no event), quarantined.",
		}, []string{"job", "status"}),
		Inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "batch_items_inflight", Help: "Source rows this process has read into chunks that are not committed or rolled back yet.",
		}, []string{"job"}),
		Retries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "batch_retry_total", Help: "Chunk retries after transient errors, by reason."}, []string{"job", "reason"}),
		RateLimitWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "batch_rate_limit_wait_seconds", Help: "Time a custom processor's external calls waited for the job's rate limiter (Config.RateLimit, Retry-After pauses included).",
			Buckets: prometheus.ExponentialBuckets(0.001, 3, 12),
		}, []string{"job"}),
		LockWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "batch_lock_wait_seconds", Help: "Time chunks spent before failing on a lock wait (lock_timeout).",
			Buckets: prometheus.ExponentialBuckets(0.01, 2.5, 10),
		}, []string{"job"}),
		RelationRoots: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "batch_relation_roots_total", Help: "Roots of a job whose documents join related tables, by status: queued (a run resolved captured changes of related rows into them), then changed (rebuilt with a new event), unchanged (rebuilt, the same document) or quarantined by the run's relation phase.",
		}, []string{"job", "status"}),
		OpenWritersExpired: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "batch_open_writers_wait_expired_total", Help: "Run starts of this process that gave up waiting for transactions that wrote the source table (OPEN_WRITERS_WAIT); a follower tries again.",
		}, []string{"job"}),
	}
	if db != nil {
		m.writersWait = &checkpointAge{db: db, query: openWritersWaitSecondsSQL, desc: prometheus.NewDesc("batch_open_writers_wait_seconds",
			"Seconds a run start of the job has been waiting for transactions that wrote its source table, read from batch_open_writers (any process's; a follower's retries count as one wait); 0 while none waits.", []string{"job"}, nil)}
		m.age = &checkpointAge{db: db, query: checkpointAgeSQL, desc: prometheus.NewDesc("batch_checkpoint_age_seconds",
			"Seconds since the last checkpoint of the job's oldest running partition or sweep, read from batch_runs and batch_sweeps (any process's); 0 while none runs.", []string{"job"}, nil)}
	}
	if reg != nil {
		reg.MustRegister(m.ChunkDuration, m.ChunkSize, m.Rows, m.Inflight, m.Retries, m.RateLimitWait, m.LockWait, m.OpenWritersExpired, m.RelationRoots)
		if m.age != nil {
			reg.MustRegister(m.age, m.writersWait)
		}
	}
	return m
}

// The reason label values of batch_retry_total.
const (
	reasonTransient   = "transient"    // a retryable database error or a lost connection
	reasonLockTimeout = "lock_timeout" // the chunk waited lock_timeout for a lock
	reasonRetryAfter  = "retry_after"  // a custom processor's service asked for a pause
	reasonSweep       = "sweep"        // a sweep chunk rolled back
)

// forJob creates job's retry and lock-wait series at zero, so that a scrape
// before the first retry or lock wait already has a line for each (and a
// rule sees the first increase from 0, not a series appearing).
func (m *Metrics) forJob(job string) {
	if m == nil {
		return
	}
	for _, reason := range []string{reasonTransient, reasonLockTimeout, reasonRetryAfter, reasonSweep} {
		m.Retries.WithLabelValues(job, reason)
	}
	m.LockWait.WithLabelValues(job)
	m.OpenWritersExpired.WithLabelValues(job)
}

// relationRoots counts n roots of job under status.
func (m *Metrics) relationRoots(job, status string, n int64) {
	if m != nil && n > 0 {
		m.RelationRoots.WithLabelValues(job, status).Add(float64(n))
	}
}

// inflight moves batch_items_inflight by n rows.
func (m *Metrics) inflight(job string, n int) {
	if m != nil && n != 0 {
		m.Inflight.WithLabelValues(job).Add(float64(n))
	}
}

// checkpointAgeSQL: per job, the age of the oldest last checkpoint among
// its running partitions and running sweeps (one without a checkpoint
// counts from its start); 0 for a job with nothing running, so the series
// is there (and an alert on it quiet) between runs.
const checkpointAgeSQL = `
SELECT job, coalesce(extract(epoch FROM max(now() - at))::float8, 0)
FROM (SELECT job, NULL::timestamptz AS at FROM batch_jobs
      UNION ALL
      SELECT job, coalesce(checkpoint_at, started_at, created_at) FROM batch_runs WHERE state = 'running'
      UNION ALL
      SELECT job, coalesce(checkpoint_at, started_at, created_at) FROM batch_sweeps WHERE state = 'running') r
GROUP BY job`

// openWritersWaitSecondsSQL: per job, how long a run start has been
// waiting for open writers (a row checked recently, and not of a one-shot
// run that gave up), else 0. A job's first
// run start waits before its batch_jobs row is committed.
const openWritersWaitSecondsSQL = `
SELECT j.job, coalesce(extract(epoch FROM now() - w.since)::float8, 0)
FROM (SELECT job FROM batch_jobs UNION SELECT job FROM batch_open_writers) j LEFT JOIN batch_open_writers w ON w.job = j.job
  AND w.checked_at > now() - ` + openWritersFresh + ` AND (w.expired_at IS NULL OR w.follower)`

// checkpointAgeTimeout bounds the scrape's query.
const checkpointAgeTimeout = 2 * time.Second

// checkpointAge is a gauge per job read by query (job, value) at each
// scrape.
type checkpointAge struct {
	db    querier
	query string
	desc  *prometheus.Desc
}

func (c *checkpointAge) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *checkpointAge) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), checkpointAgeTimeout)
	defer cancel()
	rows, err := c.db.Query(ctx, c.query)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.desc, err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var job string
		var age float64
		if err := rows.Scan(&job, &age); err != nil {
			ch <- prometheus.NewInvalidMetric(c.desc, err)
			return
		}
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, age, job)
	}
	if err := rows.Err(); err != nil {
		ch <- prometheus.NewInvalidMetric(c.desc, err)
	}
}
