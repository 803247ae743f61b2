package sink

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go/sasl"
)

// Defaults, in one place.
const (
	DefaultTopic            = "outboxrelay.records"
	DefaultGroup            = "outboxrelay-indexer"
	DefaultAlias            = "records"
	DefaultBatchSize        = 1000
	DefaultBatchBytes       = 5 << 20
	DefaultFlushInterval    = 200 * time.Millisecond
	DefaultLanes            = 2
	DefaultRetryInitial     = 200 * time.Millisecond
	DefaultRetryMax         = 10 * time.Second
	DefaultRetryMaxElapsed  = 10 * time.Minute
	DefaultMaxDocumentBytes = 10 << 20
	DefaultSessionTimeout   = 30 * time.Second
	DefaultHeartbeat        = 3 * time.Second
	DefaultRequestTimeout   = 60 * time.Second
	DefaultTopicPartitions  = 3
)

// Config configures an [Indexer]. The zero value of every optional field
// means its default.
type Config struct {
	// Brokers are the Kafka bootstrap addresses (KAFKA_BROKERS). Required.
	Brokers []string
	// TLS and SASL secure the Kafka connections (internal/kafkaconn builds
	// them from KAFKA_TLS* and KAFKA_SASL_*). nil: plaintext, no SASL.
	TLS  *tls.Config
	SASL sasl.Mechanism
	// Topic is the topic to consume. Default "outboxrelay.records".
	Topic string
	// Group is the consumer group id. Default "outboxrelay-indexer". A group
	// that has never committed starts at the earliest offset.
	Group string
	// TopicPartitions is the partition count the indexer creates Topic with
	// when it does not exist yet at start (an indexer started before the
	// first event is published). An existing topic is left as it is.
	// Default 3, what the test stack and docker-compose.yml use; keep it
	// equal to the publisher's.
	TopicPartitions int
	// DeadLetterTopic receives poison messages and permanently rejected
	// documents. Default "<Topic>.dlq".
	DeadLetterTopic string
	// DeadLetterRetention is the retention.ms the dead-letter topic is
	// created with. 0 (default) means forever (retention.ms=-1): the main
	// offsets are committed once a dead letter is written, so one that
	// expires is lost unseen. On an existing topic it is set at start when
	// the topic inherits the broker's value (as one an older indexer
	// created); a value set on the topic is kept (a warning says when it
	// differs). The same holds for DeadLetterMaxBytes.
	DeadLetterRetention time.Duration
	// DeadLetterMaxBytes is the largest dead letter (message plus error
	// headers) the writer sends, and the max.message.bytes the dead-letter
	// topic is created with. Keep it at least the main topic's
	// max.message.bytes. Default MaxDocumentBytes + 1 MiB.
	DeadLetterMaxBytes int

	// URL is the search engine's HTTP address (ELASTICSEARCH_URL), or the
	// addresses of several nodes of one cluster, comma-separated; see
	// [index.NewClient] for how requests spread over them. Required.
	URL string
	// HTTPClient sends the engine requests (credentials, TLS; internal/esconn
	// builds it). nil: a plain client.
	HTTPClient *http.Client
	// Alias is the read alias users search; it filters out delete tombstones.
	// Default "records".
	Alias string
	// WriteAlias is the alias the indexer writes through. Default
	// "<Alias>-write".
	WriteAlias string
	// Routes maps aggregate types (header ce_aggregatetype) to read aliases
	// (ROUTES=orders=orders_idx,customers=customers_idx): a record of a
	// listed type is written through that alias's write alias
	// "<alias>-write", created like Alias's when missing. Default: every
	// record to Alias.
	Routes map[string]string
	// routedFrom holds Alias and WriteAlias as they were before
	// ForAggregateType routed the config to another alias ([Config.Unrouted]).
	routedFrom *[2]string
	// AggregateTypes, if set, are the only aggregate types indexed; a record
	// of another type is skipped (committed, never sent, counted in
	// indexer_skipped_total{reason="aggregate_type"}). A record without
	// ce_aggregatetype is indexed. Default: every type.
	AggregateTypes []string
	// SkipEventTypes are event types (ce_type) other than
	// "outboxrelay.upsert" and "outboxrelay.delete" to skip the same way:
	// other producers' application events on the topic. "*" skips every
	// other type, and records without ce_type that have a value (their null
	// values are NullValues'). Default none: an unknown type is dead-lettered
	// (unknown_type), which catches a typo.
	SkipEventTypes []string
	// NullValues says what a record with a null value (a Kafka tombstone)
	// that is not a delete event means, as Kafka Connect's
	// behavior.on.null.values: "fail" (default: dead-lettered as
	// null_value, or missing_document for an upsert event), "ignore"
	// (skipped, counted) or "delete" (a delete of the key: a tombstone at
	// the ce_aggregateversion header's version, or, without one, at the
	// version the index holds for the id with version_type=external_gte;
	// see doc.go).
	NullValues string
	// IDFormat is "id" (default: _id = the Kafka key) or "type:id" (_id =
	// "<ce_aggregatetype>:<key>", for deployments whose ids collide across
	// aggregate types; a record without ce_aggregatetype is dead-lettered).
	// Package reconcile compares normalized_records ids with _id, so it
	// needs "id".
	IDFormat string

	// ProcessorVersions lists the processor versions (header
	// ce_processorversion) the indexer creates, adopts and writes index
	// generations for (PROCESSOR_VERSIONS), besides those
	// RegisteredVersions returns. A record of another version is
	// dead-lettered (unknown_processor_version): it creates no index. Both
	// unset: every version (an arbitrary header creates an index).
	ProcessorVersions []string
	// RegisteredVersions, if set, returns the processor versions scan jobs
	// registered (batch.RegisteredVersions over DATABASE_URL). It is asked
	// again when a record of a version not known yet arrives, at most once
	// per batch: a job registers its version before it enqueues any event
	// of it.
	RegisteredVersions func(ctx context.Context) ([]string, error)

	// Mapping is the create-index body (settings and mappings) used when the
	// aliases do not exist yet. Default: the embedded mapping.json.
	Mapping []byte

	// BatchSize bounds a bulk request by documents. Default 1000.
	BatchSize int
	// BatchBytes bounds a bulk request by document bytes. Default 5 MiB.
	BatchBytes int
	// FlushInterval bounds how long a partial batch waits while another
	// batch is in flight; with none in flight it goes at once (group
	// commit) unless Linger is set. Default 200ms.
	FlushInterval time.Duration
	// Linger makes a partial batch wait FlushInterval even when no bulk is
	// in flight: fewer, larger bulks at low rates, for up to FlushInterval
	// more latency per change. Default false: an idle indexer sends at once.
	Linger bool
	// Lanes is the number of bulk requests in flight at once. A partition is
	// in at most one of them at a time, so per-partition order holds.
	// Default 2.
	Lanes int
	// MaxRate caps documents per second over the whole process (all lanes).
	// 0 (default) means no cap; the indexer still slows down on its own when
	// the engine answers 429.
	MaxRate float64
	// MaxDocumentBytes: a larger document goes to the dead-letter topic
	// without being sent. Default 10 MiB.
	MaxDocumentBytes int

	// RetryInitial, RetryMax and RetryMaxElapsed shape the exponential
	// backoff (with jitter) for 429/5xx items and engine outages. Defaults
	// 200ms, 10s, 10m. When RetryMaxElapsed runs out, Run returns an error
	// without committing: a restart replays the batch.
	RetryInitial, RetryMax, RetryMaxElapsed time.Duration
	// RequestTimeout bounds one bulk request. Default 60s.
	RequestTimeout time.Duration

	// SessionTimeout and HeartbeatInterval of the consumer group. Defaults
	// 30s and 3s; a dead member's partitions move after SessionTimeout.
	SessionTimeout, HeartbeatInterval time.Duration

	// BulkObserver, if set, is called after every bulk request with its
	// document count, body bytes and latency (benchmarks, custom metrics).
	// It must be safe for concurrent use: lanes call it in parallel.
	BulkObserver func(docs, bytes int, took time.Duration)

	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Registerer receives the metrics; nil means none are registered.
	Registerer prometheus.Registerer
}

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config { return c.withDefaults() }

func (c Config) withDefaults() Config {
	c.Topic = cmp.Or(c.Topic, DefaultTopic)
	c.Group = cmp.Or(c.Group, DefaultGroup)
	c.DeadLetterTopic = cmp.Or(c.DeadLetterTopic, c.Topic+".dlq")
	c.TopicPartitions = cmp.Or(c.TopicPartitions, DefaultTopicPartitions)
	c.Alias = cmp.Or(c.Alias, DefaultAlias)
	c.NullValues = cmp.Or(c.NullValues, NullValuesFail)
	c.IDFormat = cmp.Or(c.IDFormat, IDFormatID)
	c.WriteAlias = cmp.Or(c.WriteAlias, c.Alias+"-write")
	if len(c.Mapping) == 0 {
		c.Mapping = DefaultMapping
	}
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.BatchBytes = cmp.Or(c.BatchBytes, DefaultBatchBytes)
	c.FlushInterval = cmp.Or(c.FlushInterval, DefaultFlushInterval)
	c.Lanes = cmp.Or(c.Lanes, DefaultLanes)
	c.MaxDocumentBytes = cmp.Or(c.MaxDocumentBytes, DefaultMaxDocumentBytes)
	c.DeadLetterMaxBytes = cmp.Or(c.DeadLetterMaxBytes, c.MaxDocumentBytes+1<<20)
	c.RetryInitial = cmp.Or(c.RetryInitial, DefaultRetryInitial)
	c.RetryMax = cmp.Or(c.RetryMax, DefaultRetryMax)
	c.RetryMaxElapsed = cmp.Or(c.RetryMaxElapsed, DefaultRetryMaxElapsed)
	c.RequestTimeout = cmp.Or(c.RequestTimeout, DefaultRequestTimeout)
	c.SessionTimeout = cmp.Or(c.SessionTimeout, DefaultSessionTimeout)
	c.HeartbeatInterval = cmp.Or(c.HeartbeatInterval, DefaultHeartbeat)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func (c Config) validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if len(c.Brokers) == 0 || strings.TrimSpace(strings.Join(c.Brokers, "")) == "" {
		bad("KAFKA_BROKERS is required (comma-separated host:port list)")
	}
	if c.URL == "" {
		bad("ELASTICSEARCH_URL is required (e.g. http://127.0.0.1:9200)")
	}
	if c.Alias == c.WriteAlias {
		bad("WRITE_ALIAS=%q: must differ from ALIAS", c.WriteAlias)
	}
	for typ, alias := range c.Routes {
		if typ == "" || alias == "" {
			bad("ROUTES: %q=%q: aggregate type and alias must not be empty", typ, alias)
		} else if alias == c.WriteAlias || strings.HasSuffix(alias, "-write") {
			bad("ROUTES: %s=%s: route to a read alias, not a write alias", typ, alias)
		}
	}
	switch c.NullValues {
	case NullValuesFail, NullValuesIgnore, NullValuesDelete:
	default:
		bad("NULL_VALUES=%q: want fail, ignore or delete", c.NullValues)
	}
	switch c.IDFormat {
	case IDFormatID, IDFormatTypeID:
	default:
		bad("ID_FORMAT=%q: want id or type:id", c.IDFormat)
	}
	if c.Topic == c.DeadLetterTopic {
		bad("DEAD_LETTER_TOPIC=%q: must differ from TOPIC", c.DeadLetterTopic)
	}
	if c.DeadLetterRetention < 0 {
		bad("DEAD_LETTER_RETENTION=%s: must be 0 (forever) or positive", c.DeadLetterRetention)
	}
	if c.DeadLetterMaxBytes < 1<<20 {
		bad("DEAD_LETTER_MAX_BYTES=%d: must be at least 1 MiB (1048576)", c.DeadLetterMaxBytes)
	} else if c.DeadLetterMaxBytes < c.MaxDocumentBytes {
		// A document the engine refuses could not be dead-lettered: the
		// indexer would stop on it at every start.
		bad("DEAD_LETTER_MAX_BYTES=%d: must be at least the largest document indexed (MaxDocumentBytes=%d)", c.DeadLetterMaxBytes, c.MaxDocumentBytes)
	}
	for _, t := range c.SkipEventTypes {
		if t == typeUpsert || t == typeDelete {
			bad("SKIP_EVENT_TYPES: %q is the pipeline's own event type and is always indexed", t)
		}
	}
	if c.TopicPartitions < 1 {
		bad("TOPIC_PARTITIONS=%d: must be at least 1", c.TopicPartitions)
	}
	if c.BatchSize < 1 {
		bad("BATCH_SIZE=%d: must be at least 1", c.BatchSize)
	}
	if c.BatchBytes < 1024 {
		bad("BATCH_BYTES=%d: must be at least 1024", c.BatchBytes)
	}
	if c.Lanes < 1 || c.Lanes > 256 {
		bad("LANES=%d: must be between 1 and 256", c.Lanes)
	}
	if c.MaxRate < 0 {
		bad("MAX_RATE=%g: must be 0 (no cap) or positive", c.MaxRate)
	}
	if c.FlushInterval < 0 {
		bad("FLUSH_INTERVAL=%s: must be positive", c.FlushInterval)
	}
	if c.SessionTimeout < 6*time.Second {
		bad("SESSION_TIMEOUT=%s: Kafka brokers refuse less than 6s by default", c.SessionTimeout)
	}
	if c.HeartbeatInterval <= 0 || c.HeartbeatInterval >= c.SessionTimeout {
		bad("HEARTBEAT_INTERVAL=%s: must be positive and below SESSION_TIMEOUT", c.HeartbeatInterval)
	}
	return errors.Join(errs...)
}
