package sink

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
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

	// URL is the search engine's HTTP address (ELASTICSEARCH_URL). Required.
	URL string
	// Alias is the read alias users search; it filters out delete tombstones.
	// Default "records".
	Alias string
	// WriteAlias is the alias the indexer writes through. Default
	// "<Alias>-write".
	WriteAlias string
	// Mapping is the create-index body (settings and mappings) used when the
	// aliases do not exist yet. Default: the embedded mapping.json.
	Mapping []byte

	// BatchSize bounds a bulk request by documents. Default 1000.
	BatchSize int
	// BatchBytes bounds a bulk request by document bytes. Default 5 MiB.
	BatchBytes int
	// FlushInterval bounds how long a partial batch waits. Default 200ms.
	FlushInterval time.Duration
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

func (c Config) withDefaults() Config {
	c.Topic = cmp.Or(c.Topic, DefaultTopic)
	c.Group = cmp.Or(c.Group, DefaultGroup)
	c.DeadLetterTopic = cmp.Or(c.DeadLetterTopic, c.Topic+".dlq")
	c.TopicPartitions = cmp.Or(c.TopicPartitions, DefaultTopicPartitions)
	c.Alias = cmp.Or(c.Alias, DefaultAlias)
	c.WriteAlias = cmp.Or(c.WriteAlias, c.Alias+"-write")
	if len(c.Mapping) == 0 {
		c.Mapping = DefaultMapping
	}
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.BatchBytes = cmp.Or(c.BatchBytes, DefaultBatchBytes)
	c.FlushInterval = cmp.Or(c.FlushInterval, DefaultFlushInterval)
	c.Lanes = cmp.Or(c.Lanes, DefaultLanes)
	c.MaxDocumentBytes = cmp.Or(c.MaxDocumentBytes, DefaultMaxDocumentBytes)
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
	if c.Topic == c.DeadLetterTopic {
		bad("DEAD_LETTER_TOPIC=%q: must differ from TOPIC", c.DeadLetterTopic)
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
