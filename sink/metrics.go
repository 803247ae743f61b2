package sink

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// The reason label values of indexer_retries_total.
const (
	retryRequest   = "request"    // the whole bulk request failed (counted per document)
	retryItem429   = "item_429"   // an item refused with 429 (engine overloaded)
	retryItem5xx   = "item_5xx"   // an item refused with a 5xx status
	retryItemOther = "item_other" // an item refused with another retryable error
	retryBisect    = "bisect"     // a request refused in a way one item can cause, sent again in halves (per document)
)

// metrics are the indexer's Prometheus series. Names start with indexer_.
type metrics struct {
	docs        *prometheus.CounterVec // result = indexed | deleted | conflict | dead_lettered | skipped
	retries     *prometheus.CounterVec // reason = item_429 | item_5xx | item_other | request | bisect
	deadLetters *prometheus.CounterVec // code
	skipped     *prometheus.CounterVec // reason = aggregate_type | event_type | null_value | txn_marker
	bulkSeconds prometheus.Histogram
	bulkDocs    prometheus.Histogram
	bulkBytes   prometheus.Histogram
	lag         *prometheus.GaugeVec // partition
	rateLimit   prometheus.Gauge
	commitErrs  prometheus.Counter
	// deadLetterTopic: state = stored (in the dead-letter topic) | pending
	// (not re-published by `dead-letter replay` yet).
	deadLetterTopic *prometheus.GaugeVec
	// generationDocs: alias, index, state = live | building | old
	// (watchGenerations).
	generationDocs *prometheus.GaugeVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		docs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "indexer_docs_total",
			Help: "Documents resolved, by result: indexed, deleted (tombstone written), conflict (stale or duplicate, counted as success), dead_lettered, skipped (not indexed by this deployment; see indexer_skipped_total).",
		}, []string{"result"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "indexer_retries_total",
			Help: "Bulk items (or whole requests) sent again, by reason.",
		}, []string{"reason"}),
		deadLetters: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "indexer_dead_lettered_total",
			Help: "Messages written to the dead-letter topic, by error code.",
		}, []string{"code"}),
		skipped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "indexer_skipped_total",
			Help: "Messages the deployment does not index (committed, never sent), by reason: aggregate_type (AGGREGATE_TYPES), event_type (SKIP_EVENT_TYPES), null_value (NULL_VALUES=ignore), txn_marker (another producer's transaction marker: no message, only an offset to commit).",
		}, []string{"reason"}),
		bulkSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "indexer_bulk_duration_seconds",
			Help:    "Latency of one bulk request.",
			Buckets: prometheus.ExponentialBuckets(0.005, 2, 14),
		}),
		bulkDocs: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "indexer_bulk_size_docs",
			Help:    "Documents per bulk request.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 14),
		}),
		bulkBytes: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "indexer_bulk_size_bytes",
			Help:    "Bytes per bulk request body.",
			Buckets: prometheus.ExponentialBuckets(1024, 2, 14),
		}),
		lag: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "indexer_consumer_lag",
			Help: "Messages behind the partition's high watermark after the last resolved batch.",
		}, []string{"partition"}),
		rateLimit: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "indexer_rate_limit_docs_per_second",
			Help: "Current document budget of the process; 0 means unlimited.",
		}),
		commitErrs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "indexer_commit_errors_total",
			Help: "Offset commits that failed (the messages are replayed, harmlessly).",
		}),
		generationDocs: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "indexer_generation_docs",
			Help: "Documents (tombstones included) in each index generation of the indexer's aliases, read from the engine every 30s; state = live (the read alias points at it), building (created after the live one: a rebuild not cut over yet), old (kept for rollback).",
		}, []string{"alias", "index", "state"}),
		deadLetterTopic: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "indexer_dead_letter_topic_messages",
			Help: "Messages in the dead-letter topic (state=stored) and those of them not re-published by `indexer dead-letter replay` yet (state=pending); alert on pending > 0.",
		}, []string{"state"}),
	}
	// Every known reason's series exists from the start, at 0: a scrape
	// before the first retry or skip has a line for it, and a rule sees
	// the first increase rather than a series appearing.
	for _, reason := range []string{retryRequest, retryItem429, retryItem5xx, retryItemOther, retryBisect} {
		m.retries.WithLabelValues(reason)
	}
	for _, reason := range []string{SkipAggregateType, SkipEventType, SkipNullValue, SkipTxnMarker} {
		m.skipped.WithLabelValues(reason)
	}
	if reg != nil {
		reg.MustRegister(m.docs, m.retries, m.deadLetters, m.skipped, m.bulkSeconds, m.bulkDocs, m.bulkBytes, m.lag, m.rateLimit, m.commitErrs, m.deadLetterTopic, m.generationDocs)
	}
	return m
}

func (m *metrics) setLag(partition int, lag int64) {
	m.lag.WithLabelValues(strconv.Itoa(partition)).Set(float64(lag))
}
