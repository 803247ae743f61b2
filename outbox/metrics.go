package outbox

import "github.com/prometheus/client_golang/prometheus"

// Error kinds of outbox_publish_errors_total.
const (
	errKindBroker    = "broker"   // transient produce error, retried
	errKindRejected  = "rejected" // permanent: the event was dead-lettered
	errKindDatabase  = "database" // reading or recording failed
	errKindLeaseLost = "lease_lost"
)

type publisherMetrics struct {
	published   prometheus.Counter
	deadLetters prometheus.Counter
	errors      *prometheus.CounterVec
	latency     prometheus.Histogram
	batchSize   prometheus.Histogram
	backlog     prometheus.Gauge
	oldestAge   prometheus.Gauge
	shards      prometheus.Gauge
}

func newPublisherMetrics(reg prometheus.Registerer) *publisherMetrics {
	m := &publisherMetrics{
		published: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_events_published_total", Help: "Events acknowledged by the broker and removed from the outbox.",
		}),
		deadLetters: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_dead_letters_total", Help: "Events the broker rejected permanently, moved to outbox_dead_letters.",
		}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_publish_errors_total", Help: "Publisher errors by kind: broker (retried), rejected (dead-lettered), database, lease_lost.",
		}, []string{"kind"}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "outbox_publish_latency_seconds",
			Help:    "Time from the event's insert (created_at, about its commit) to the broker's acknowledgement.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}),
		batchSize: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "outbox_publish_batch_size", Help: "Events per produce call.",
			Buckets: prometheus.ExponentialBuckets(1, 4, 8),
		}),
		backlog: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_backlog_events", Help: "Unpublished events in outbox_events (all shards), from PostgreSQL's live-row statistics: about a second behind; publisher status counts exactly.",
		}),
		oldestAge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_oldest_event_age_seconds", Help: "Age of the oldest unpublished event; 0 when the outbox is empty.",
		}),
		shards: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_shards_owned", Help: "Outbox shards this publisher holds a lease on.",
		}),
	}
	for _, k := range []string{errKindBroker, errKindRejected, errKindDatabase, errKindLeaseLost} {
		m.errors.WithLabelValues(k)
	}
	if reg != nil {
		reg.MustRegister(m.published, m.deadLetters, m.errors, m.latency, m.batchSize, m.backlog, m.oldestAge, m.shards)
	}
	return m
}
