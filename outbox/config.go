package outbox

import (
	"cmp"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go/compress"
	"github.com/segmentio/kafka-go/sasl"

	"github.com/outboxrelay/outboxrelay/internal/metrics"
)

// Defaults of [Config], in one place.
const (
	DefaultLeaseTTL        = 10 * time.Second
	DefaultPollInterval    = time.Second
	DefaultBatchSize       = 2000
	DefaultBatchBytes      = 1_000_000
	DefaultWriteTimeout    = 10 * time.Second
	DefaultRetryMaxElapsed = time.Minute
	DefaultBacklogInterval = 5 * time.Second
	DefaultTopicWait       = 30 * time.Second
	DefaultSource          = "outboxrelay"
	DefaultMaxConns        = 8
	DefaultCompression     = "lz4"
)

// Config configures a [Publisher]. The zero value of every field but Brokers
// means "the default".
type Config struct {
	// Brokers are the Kafka bootstrap addresses ("host:port"). Required.
	Brokers []string
	// TLS and SASL secure the Kafka connections (internal/kafkaconn builds
	// them from KAFKA_TLS* and KAFKA_SASL_*). nil: plaintext, no SASL.
	TLS  *tls.Config
	SASL sasl.Mechanism
	// ID names this publisher in the lease table. Default: hostname-pid-random.
	// Two running publishers never share an ID: Run returns
	// ErrPublisherIDInUse in a process that starts with the ID of a running
	// one (after waiting up to LeaseTTL for a previous process's membership
	// under the ID to run out, as after a crash and restart).
	ID string
	// LeaseTTL is how long a shard lease and a membership last without a
	// heartbeat; heartbeats run every LeaseTTL/3. A publisher that dies is
	// replaced after at most LeaseTTL. Default 10s, minimum 300ms.
	LeaseTTL time.Duration
	// PollInterval is the polling fallback when no NOTIFY arrives (e.g. the
	// listening connection is down), and the only wake-up of idle shards
	// with NoListen or the NOTIFY trigger off (then consider 100ms: an idle
	// publisher costs one small query per interval). Default 1s.
	PollInterval time.Duration
	// NoListen turns LISTEN off: no session connection waits for the
	// outbox trigger's NOTIFY and for membership announcements, idle
	// shards are found by polling every PollInterval and membership changes
	// at the next heartbeat. LISTEN needs a session of its own, so set it
	// behind PgBouncer in transaction mode (and DATABASE_URL's
	// default_query_exec_mode=exec or simple_protocol there: no prepared
	// statements outlive a transaction).
	NoListen bool
	// ShardConns is how many connections (lanes) the shard work uses, each
	// opened when a shard first needs it; 64/ShardConns shards share one.
	// Default 0: the pool's MaxConns.
	ShardConns int
	// BatchSize is the most events one shard sends in one produce
	// call. Default 2000.
	BatchSize int
	// BatchBytes caps the bytes of one call (kafka-go's size estimate) and is
	// the most one partition's produce request carries; one event larger than this is dead-lettered.
	// Keep it at or below the broker's message.max.bytes. Default 1,000,000.
	BatchBytes int
	// Compression is the codec of the record batches sent to Kafka: none,
	// gzip, snappy, lz4 or zstd. Consumers decompress whatever the
	// batches carry. Default lz4: it cut the broker's CPU-seconds per
	// event by a fifth in bench-e2e, at no measurable cost to the publisher.
	Compression string
	// WriteTimeout bounds the writing of one produce attempt; its writing
	// also ends at the shard's lease deadline (LeaseTTL/10 before the lease
	// can be taken over), whichever comes first. What was written by then
	// is waited for WriteTimeout more: the broker's acknowledgement, which
	// acks=all holds until the in-sync replicas have the records. Default
	// 10s.
	WriteTimeout time.Duration
	// RetryMaxElapsed bounds one retry loop (a produce or a database write);
	// the shard then starts over from the database. Default 1m.
	RetryMaxElapsed time.Duration
	// TopicWait is how long an event waits for its topic when the broker
	// says the topic does not exist or the publisher may not write to it;
	// then the event goes to outbox_dead_letters, and so do the topic's
	// later events until the topic works again. Topics are never created by
	// the publisher (see EnsureTopics). Default 30s.
	TopicWait time.Duration
	// Topics, when set, lists the only topics the publisher writes to
	// (PUBLISHER_TOPICS, parsed by [ParseTopicSpecs]): an event of any other
	// topic is treated as one whose topic is missing, so it waits TopicWait
	// and then goes to outbox_dead_letters, even when the broker has that
	// topic (a typo that someone's auto-creation made real). The partition
	// counts and replication factors are what EnsureTopics creates. Default
	// nil: every topic the broker has.
	Topics []TopicSpec
	// Retention keeps published rows in outbox_published this long before
	// they are deleted in batches. 0 (default) deletes them at once.
	Retention time.Duration
	// BacklogInterval is how often the backlog gauges are refreshed.
	// Default 5s.
	BacklogInterval time.Duration
	// Source is the CloudEvents ce_source. Default "outboxrelay".
	Source string
	// Dial opens the connections to the brokers (a proxy, a custom
	// network). nil: a net.Dialer with a 5s timeout.
	Dial func(ctx context.Context, network, address string) (net.Conn, error)
	// Registerer receives the publisher's metrics. nil: not registered.
	Registerer prometheus.Registerer
	// Health is marked degraded while the broker fails. nil: not reported.
	Health *metrics.Health
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// OnPublished, when set, is called after each batch is acknowledged by
	// the broker and recorded in the database (tests, benchmarks).
	OnPublished func(shard int, events []Published)
}

// Published describes one event the broker acknowledged.
type Published struct {
	EventID          string
	AggregateID      string
	AggregateVersion int64
	CreatedAt        time.Time
	AckedAt          time.Time
}

func (c Config) withDefaults() Config {
	c.ID = cmp.Or(c.ID, defaultID())
	c.LeaseTTL = cmp.Or(c.LeaseTTL, DefaultLeaseTTL)
	c.PollInterval = cmp.Or(c.PollInterval, DefaultPollInterval)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.BatchBytes = cmp.Or(c.BatchBytes, DefaultBatchBytes)
	c.WriteTimeout = cmp.Or(c.WriteTimeout, DefaultWriteTimeout)
	c.RetryMaxElapsed = cmp.Or(c.RetryMaxElapsed, DefaultRetryMaxElapsed)
	c.BacklogInterval = cmp.Or(c.BacklogInterval, DefaultBacklogInterval)
	c.TopicWait = cmp.Or(c.TopicWait, DefaultTopicWait)
	c.Source = cmp.Or(c.Source, DefaultSource)
	c.Compression = cmp.Or(c.Compression, DefaultCompression)
	if c.Dial == nil {
		c.Dial = (&net.Dialer{Timeout: 5 * time.Second}).DialContext
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func (c Config) validate() error {
	switch {
	case len(c.Brokers) == 0 || c.Brokers[0] == "":
		return fmt.Errorf("KAFKA_BROKERS is empty (e.g. localhost:9092)")
	case c.LeaseTTL < 300*time.Millisecond:
		return fmt.Errorf("LEASE_TTL=%s: must be at least 300ms", c.LeaseTTL)
	case c.PollInterval < 0:
		return fmt.Errorf("POLL_INTERVAL=%s: must be > 0", c.PollInterval)
	case c.BatchSize < 1 || c.BatchSize > 100_000:
		return fmt.Errorf("BATCH_SIZE=%d: must be between 1 and 100000", c.BatchSize)
	case c.BatchBytes < 1024:
		return fmt.Errorf("BATCH_BYTES=%d: must be at least 1024", c.BatchBytes)
	case c.WriteTimeout <= 0:
		return fmt.Errorf("WRITE_TIMEOUT=%s: must be > 0", c.WriteTimeout)
	case c.RetryMaxElapsed <= 0:
		return fmt.Errorf("RETRY_MAX_ELAPSED=%s: must be > 0", c.RetryMaxElapsed)
	case c.ShardConns < 0 || c.ShardConns > NumShards:
		return fmt.Errorf("DATABASE_MAX_CONNS=%d: must be between 1 and %d", c.ShardConns, NumShards)
	case c.TopicWait < 0:
		return fmt.Errorf("TOPIC_WAIT=%s: must be >= 0", c.TopicWait)
	case !validCompression(c.Compression):
		return fmt.Errorf("COMPRESSION=%q: must be none, gzip, snappy, lz4 or zstd", c.Compression)
	case c.Retention < 0:
		return fmt.Errorf("RETENTION=%s: must be >= 0 (0 deletes published events at once)", c.Retention)
	}
	if err := validateTopicSpecs(c.Topics); err != nil {
		return fmt.Errorf("PUBLISHER_TOPICS: %w", err)
	}
	return nil
}

func defaultID() string {
	host, _ := os.Hostname()
	var b [3]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s-%d-%s", cmp.Or(host, "publisher"), os.Getpid(), hex.EncodeToString(b[:]))
}

func validCompression(name string) bool {
	var c compress.Compression
	return c.UnmarshalText([]byte(name)) == nil
}
