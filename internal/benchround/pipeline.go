package benchround

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"
	"github.com/segmentio/kafka-go"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// Pipeline is what a whole-pipeline benchmark runs its binaries against:
// the shared test stack, a topic and an alias of its own (the alias's
// generations are deleted when the benchmark ends), the three binaries
// built, and the environment they all share.
type Pipeline struct {
	DatabaseURL string
	Pool        *pgxpool.Pool
	Brokers     []string
	SearchURL   string
	Search      *elastic.Client
	Topic       string
	Alias       string
	Bins        map[string]string // batcher, publisher, indexer
	// Env is the environment of every binary: the stack, TOPIC, GROUP,
	// ALIAS, no metrics listener or progress bar, JSON logs at warn.
	Env []string
}

// NewPipeline sets up a Pipeline whose topic, named after name, has
// partitions partitions.
func NewPipeline(tb testing.TB, name string, partitions int) *Pipeline {
	tb.Helper()
	p := &Pipeline{DatabaseURL: stack.Database(tb), Brokers: stack.KafkaBrokers(tb), SearchURL: stack.ElasticsearchURL(tb)}
	p.Pool = stack.Pool(tb, p.DatabaseURL)
	var err error
	if p.Search, err = index.NewClient(p.SearchURL); err != nil {
		tb.Fatal(err)
	}
	p.Topic, p.Alias = stack.UniqueName(name), stack.UniqueName(name)
	tb.Cleanup(func() { _, _ = p.Search.DeleteIndex(p.Alias + "_v*").Do(context.Background()) })
	kc := &kafka.Client{Addr: kafka.TCP(p.Brokers...), Timeout: 30 * time.Second}
	res, err := kc.CreateTopics(context.Background(), &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: p.Topic, NumPartitions: partitions, ReplicationFactor: 1}}})
	if err != nil {
		tb.Fatalf("create topic %s: %v", p.Topic, err)
	}
	for _, e := range res.Errors {
		if e != nil {
			tb.Fatalf("create topic %s: %v", p.Topic, e)
		}
	}
	p.Bins = map[string]string{}
	for _, n := range []string{"batcher", "publisher", "indexer"} {
		p.Bins[n] = testproc.Build(tb, n)
	}
	p.Env = []string{"DATABASE_URL=" + p.DatabaseURL, "KAFKA_BROKERS=" + strings.Join(p.Brokers, ","), "ELASTICSEARCH_URL=" + p.SearchURL,
		"TOPIC=" + p.Topic, "GROUP=" + p.Topic, "ALIAS=" + p.Alias, "METRICS_ADDR=", "PROGRESS=off", "LOG_FORMAT=json", "LOG_LEVEL=warn"}
	return p
}

// With returns Env followed by extra.
func (p *Pipeline) With(extra ...string) []string {
	return append(append([]string{}, p.Env...), extra...)
}
