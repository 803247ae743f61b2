package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/metrics"
	"github.com/outboxrelay/outboxrelay/internal/shutdown"
	"github.com/outboxrelay/outboxrelay/sink"
)

// settings binds sink.Config to flags and environment variables.
type settings struct {
	common      cli.Common
	brokers     string
	mappingFile string
	metricsAddr string
	cfg         sink.Config
}

func (s *settings) registerKafka(fs *cli.FlagSet) {
	fs.String(&s.brokers, "kafka-brokers", "KAFKA_BROKERS", "", "Kafka bootstrap brokers, comma-separated host:port (required)")
	fs.String(&s.cfg.Topic, "topic", "TOPIC", sink.DefaultTopic, "topic to consume")
	fs.String(&s.cfg.Group, "group", "GROUP", sink.DefaultGroup, "consumer group id")
	fs.String(&s.cfg.DeadLetterTopic, "dead-letter-topic", "DEAD_LETTER_TOPIC", "", `dead-letter topic ("" = <topic>.dlq)`)
}

func (s *settings) registerEngine(fs *cli.FlagSet) {
	fs.Secret(&s.cfg.URL, "elasticsearch-url", "ELASTICSEARCH_URL", "", "search engine URL, e.g. http://127.0.0.1:9200 (required)")
	fs.String(&s.cfg.Alias, "alias", "ALIAS", sink.DefaultAlias, "read alias users search (filters out delete tombstones)")
	fs.String(&s.cfg.WriteAlias, "write-alias", "WRITE_ALIAS", "", `alias the indexer writes through ("" = <alias>-write)`)
	fs.String(&s.mappingFile, "mapping-file", "MAPPING_FILE", "", `create-index body (settings, mappings) used when the index is created ("" = built-in mapping.json)`)
}

func (s *settings) registerRun(fs *cli.FlagSet) {
	fs.Int(&s.cfg.TopicPartitions, "topic-partitions", "TOPIC_PARTITIONS", sink.DefaultTopicPartitions, "partitions of the topic when it is missing at start and the indexer creates it (keep equal to the publisher's)")
	fs.Int(&s.cfg.BatchSize, "batch-size", "BATCH_SIZE", sink.DefaultBatchSize, "documents per bulk request at most")
	fs.Int(&s.cfg.BatchBytes, "batch-bytes", "BATCH_BYTES", sink.DefaultBatchBytes, "document bytes per bulk request at most")
	fs.Duration(&s.cfg.FlushInterval, "flush-interval", "FLUSH_INTERVAL", sink.DefaultFlushInterval, "how long a partial batch waits for more messages")
	fs.Int(&s.cfg.Lanes, "lanes", "LANES", sink.DefaultLanes, "concurrent bulk requests (a partition is in one at a time)")
	fs.Float(&s.cfg.MaxRate, "max-rate", "MAX_RATE", 0, "documents per second for the whole process (0 = no cap; 429s slow down anyway)")
	fs.Duration(&s.cfg.RetryMaxElapsed, "retry-max-elapsed", "RETRY_MAX_ELAPSED", sink.DefaultRetryMaxElapsed, "give up (exit 1, nothing committed) when a batch is refused this long")
	fs.Duration(&s.cfg.SessionTimeout, "session-timeout", "SESSION_TIMEOUT", sink.DefaultSessionTimeout, "consumer group session timeout (a dead member's partitions move after it)")
	fs.Duration(&s.cfg.HeartbeatInterval, "heartbeat-interval", "HEARTBEAT_INTERVAL", sink.DefaultHeartbeat, "consumer group heartbeat interval")
	fs.String(&s.metricsAddr, "metrics-addr", "METRICS_ADDR", "127.0.0.1:9103", `address for /metrics, /healthz and /readyz ("" disables)`)
}

// load turns the parsed settings into a config and a logger.
func (s *settings) load(needEngine bool) (*slog.Logger, error) {
	logger, err := s.common.Logger()
	if err != nil {
		return nil, err
	}
	s.cfg.Logger = logger
	for _, b := range strings.Split(s.brokers, ",") {
		if b = strings.TrimSpace(b); b != "" {
			s.cfg.Brokers = append(s.cfg.Brokers, b)
		}
	}
	if len(s.cfg.Brokers) == 0 {
		return nil, cli.UsageError("KAFKA_BROKERS is required (comma-separated host:port list)")
	}
	if needEngine && s.cfg.URL == "" {
		return nil, cli.UsageError("ELASTICSEARCH_URL is required (e.g. http://127.0.0.1:9200)")
	}
	if s.mappingFile != "" {
		b, err := os.ReadFile(s.mappingFile)
		if err != nil {
			return nil, cli.UsageError("MAPPING_FILE=%q: %v", s.mappingFile, err)
		}
		s.cfg.Mapping = b
	}
	return logger, nil
}

func usageIfConfig(err error) error {
	var ce *sink.ConfigError
	if errors.As(err, &ce) {
		return cli.UsageError("%v", ce.Err)
	}
	return err
}

func runCommand() cli.Command {
	return cli.Command{
		Name:    "run",
		Summary: "consume the topic and index every record (until SIGTERM)",
		Run: func(ctx context.Context, args []string) error {
			var s settings
			fs := cli.NewFlagSet("indexer run", "Consumes the topic in a consumer group, bulk-indexes by aggregate id and version\n(version_type=external), commits offsets only after every item is resolved.")
			s.registerKafka(fs)
			s.registerEngine(fs)
			s.registerRun(fs)
			s.common.RegisterLogging(fs)
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			logger, err := s.load(true)
			if err != nil {
				return err
			}
			reg := metrics.NewRegistry()
			s.cfg.Registerer = reg
			ix, err := sink.New(s.cfg)
			if err != nil {
				return usageIfConfig(err)
			}
			// Stopping abandons the batch in flight: it is not committed, so
			// whoever owns the partition next replays it, harmlessly.
			soft, _, stop := shutdown.Contexts(ctx, 0, logger)
			defer stop()
			health := metrics.NewHealth()
			health.AddCheck("search engine", ix.Ping)
			if err := metrics.Serve(soft, s.metricsAddr, reg, health, logger); err != nil {
				return cli.UsageError("%v", err)
			}
			return ix.Run(soft)
		},
	}
}

func statusCommand(stdout io.Writer) cli.Command {
	return cli.Command{
		Name:    "status",
		Summary: "print consumer lag per partition, dead-letter counts and the aliases",
		Run: func(ctx context.Context, args []string) error {
			var s settings
			fs := cli.NewFlagSet("indexer status", "Reads the group's committed offsets and the partitions' end offsets from Kafka.\nThe aliases are shown when ELASTICSEARCH_URL is set.")
			s.registerKafka(fs)
			s.registerEngine(fs)
			s.common.RegisterLogging(fs)
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			if _, err := s.load(false); err != nil {
				return err
			}
			st, err := sink.GetStatus(ctx, s.cfg)
			if err != nil {
				return err
			}
			st.Write(stdout)
			return nil
		},
	}
}

func replayCommand(stdout io.Writer) cli.Command {
	return cli.Command{
		Name:    "dead-letter replay",
		Summary: "re-publish dead-lettered messages to their topic (after fixing the cause)",
		Run: func(ctx context.Context, args []string) error {
			var s settings
			fs := cli.NewFlagSet("indexer dead-letter replay", "Re-publishes every dead-lettered message not replayed before, with its original key, value and\nheaders, to the topic it came from; progress is kept as offsets of group <group>.dlq-replay.")
			s.registerKafka(fs)
			s.common.RegisterLogging(fs)
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			if _, err := s.load(false); err != nil {
				return err
			}
			res, err := sink.ReplayDeadLetters(ctx, s.cfg)
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "re-published %d message(s)\n", res.Republished)
			for t, n := range res.ByTopic {
				fmt.Fprintf(stdout, "  %s: %d\n", t, n)
			}
			return nil
		},
	}
}

func reindexCommand(stdout io.Writer) cli.Command {
	return cli.Command{
		Name:    "reindex",
		Summary: "rebuild into a new index without downtime, then swap the read alias atomically",
		Run: func(ctx context.Context, args []string) error {
			var s settings
			var opts sink.ReindexOptions
			fs := cli.NewFlagSet("indexer reindex", "Creates --into from the mapping, moves the write alias to it (running indexers write there),\ncopies the current index keeping external versions, then swaps the read alias in one call.")
			s.registerEngine(fs)
			s.common.RegisterLogging(fs)
			fs.String(&opts.Into, "into", "", "", "the new index, e.g. records_v2 (required)")
			fs.Duration(&opts.Settle, "settle", "", 5*time.Second, "wait after moving the write alias, for bulk requests already routed to the old index")
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			s.brokers = "unused:0" // reindex does not talk to Kafka
			if _, err := s.load(true); err != nil {
				return err
			}
			res, err := sink.Reindex(ctx, s.cfg, opts)
			if err != nil {
				return usageIfConfig(err)
			}
			fmt.Fprintf(stdout, "alias %s now reads %s (was %s): %d copied, %d already newer, in %s\n",
				s.cfg.Alias, res.Into, res.From, res.Copied, res.Conflicts, res.Took.Round(time.Millisecond))
			return nil
		},
	}
}
