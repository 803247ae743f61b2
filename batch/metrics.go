package batch

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the batcher's Prometheus series (names from seed 002).
type Metrics struct {
	ChunkDuration *prometheus.HistogramVec // batch_chunk_duration_seconds{job,phase}
	ChunkSize     *prometheus.GaugeVec     // batch_chunk_size{job}
	Rows          *prometheus.CounterVec   // batch_rows_processed_total{job,status}
	Retries       *prometheus.CounterVec   // batch_retry_total{job,reason}
	LockWait      *prometheus.HistogramVec // batch_lock_wait_seconds{job}
	age           *checkpointAge           // batch_checkpoint_age_seconds{job}
}

// NewMetrics registers the series on reg (nil: not registered, still
// usable).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		ChunkDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "batch_chunk_duration_seconds", Help: "Duration of each phase of a chunk: fetch (SQL path: the one select-normalize-upsert-outbox statement; Go path: the read), process (Go path: the processor), commit (Go path: the unnest upsert-outbox statement; both: checkpoint UPDATE and COMMIT), total.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2.5, 14),
		}, []string{"job", "phase"}),
		ChunkSize: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "batch_chunk_size", Help: "Chunk size in use (rows)."}, []string{"job"}),
		Rows: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "batch_rows_processed_total", Help: "Source rows committed, by status: changed (new event), unchanged (same version, no event), quarantined.",
		}, []string{"job", "status"}),
		Retries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "batch_retry_total", Help: "Chunk retries after transient errors, by reason."}, []string{"job", "reason"}),
		LockWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "batch_lock_wait_seconds", Help: "Time chunks spent before failing on a lock wait (lock_timeout).",
			Buckets: prometheus.ExponentialBuckets(0.01, 2.5, 10),
		}, []string{"job"}),
		age: &checkpointAge{last: map[string]time.Time{}, desc: prometheus.NewDesc("batch_checkpoint_age_seconds", "Seconds since this process last committed a checkpoint of the job.", []string{"job"}, nil)},
	}
	if reg != nil {
		reg.MustRegister(m.ChunkDuration, m.ChunkSize, m.Rows, m.Retries, m.LockWait, m.age)
	}
	return m
}

func (m *Metrics) checkpointed(job string) {
	if m == nil {
		return
	}
	m.age.mu.Lock()
	m.age.last[job] = time.Now()
	m.age.mu.Unlock()
}

type checkpointAge struct {
	mu   sync.Mutex
	last map[string]time.Time
	desc *prometheus.Desc
}

func (c *checkpointAge) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *checkpointAge) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for job, t := range c.last {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, time.Since(t).Seconds(), job)
	}
}
