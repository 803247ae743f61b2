package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/esconn"
	"github.com/outboxrelay/outboxrelay/internal/kafkaconn"
	"github.com/outboxrelay/outboxrelay/internal/metrics"
	"github.com/outboxrelay/outboxrelay/internal/shutdown"
	"github.com/outboxrelay/outboxrelay/reconcile"
	"github.com/outboxrelay/outboxrelay/sink"
)

// settings binds sink.Config to flags and environment variables.
type settings struct {
	common  cli.Common
	brokers string
	// noKafka: the command talks to the engine only (reindex, cutover,
	// rollback, generations drop): no broker is required or probed.
	noKafka     bool
	mappingFile string
	metrics     cli.Metrics
	kafkaSec    kafkaconn.Settings
	engineSec   esconn.Settings
	// record settings, parsed into cfg by load
	routes, aggregateTypes, skipEventTypes string
	cfg                                    sink.Config
	// indexer run's automatic cutover (reconcile.AutoCutover)
	autoCutover         string
	autoCutoverInterval time.Duration
	// indexer run's scheduled tombstone purge
	purge purgeSettings
	// PROCESSOR_VERSIONS (sink.Config.ProcessorVersions)
	processorVersions string
}

func (s *settings) registerKafka(fs *cli.FlagSet) {
	fs.String(&s.brokers, "kafka-brokers", "KAFKA_BROKERS", "", "Kafka bootstrap brokers, comma-separated host:port (required)")
	s.kafkaSec.Register(fs)
	fs.String(&s.cfg.Topic, "topic", "TOPIC", sink.DefaultTopic, "topic to consume")
	fs.String(&s.cfg.Group, "group", "GROUP", sink.DefaultGroup, "consumer group id")
	fs.String(&s.cfg.DeadLetterTopic, "dead-letter-topic", "DEAD_LETTER_TOPIC", "", `dead-letter topic ("" = <topic>.dlq)`)
}

func (s *settings) registerEngine(fs *cli.FlagSet) {
	fs.SecretOrFile(&s.cfg.URL, "elasticsearch-url", "ELASTICSEARCH_URL", "search engine URL, e.g. http://127.0.0.1:9200, or several nodes' URLs comma-separated (required)")
	s.engineSec.Register(fs)
	fs.String(&s.cfg.Alias, "alias", "ALIAS", sink.DefaultAlias, "read alias users search (filters out delete tombstones)")
	fs.String(&s.cfg.WriteAlias, "write-alias", "WRITE_ALIAS", "", `alias the indexer writes through ("" = <alias>-write)`)
	fs.String(&s.mappingFile, "mapping-file", "MAPPING_FILE", "", `create-index body (settings, mappings) used when the index is created ("" = built-in mapping.json)`)
}

func (s *settings) registerRecords(fs *cli.FlagSet) {
	fs.String(&s.routes, "routes", "ROUTES", "", `aggregate type → read alias, e.g. "orders=orders_idx,users=users_idx", written through "<alias>-write" ("" = everything to ALIAS)`)
	fs.String(&s.aggregateTypes, "aggregate-types", "AGGREGATE_TYPES", "", `comma-separated aggregate types (ce_aggregatetype) to index; others are skipped, counted ("" = all)`)
	fs.String(&s.skipEventTypes, "skip-event-types", "SKIP_EVENT_TYPES", "", `comma-separated event types (ce_type) of other producers to skip, counted ("*" = every type but upsert/delete, and records without ce_type; "" = dead-letter them as unknown_type)`)
	fs.String(&s.cfg.NullValues, "null-values", "NULL_VALUES", sink.NullValuesFail, "a null value (Kafka tombstone) that is not a delete event: fail (dead-letter), ignore (skip, counted) or delete")
	fs.String(&s.cfg.IDFormat, "id-format", "ID_FORMAT", sink.IDFormatID, `_id of a document: id (the key) or type:id ("<aggregate type>:<key>", where ids collide across types; reconcile needs id)`)
}

func splitList(s string) []string {
	var out []string
	for _, v := range strings.Split(s, ",") {
		if v = strings.TrimSpace(v); v != "" {
			out = append(out, v)
		}
	}
	return out
}

func (s *settings) registerRun(fs *cli.FlagSet) {
	fs.Int(&s.cfg.TopicPartitions, "topic-partitions", "TOPIC_PARTITIONS", sink.DefaultTopicPartitions, "partitions of the topic when it is missing at start and the indexer creates it (keep equal to the publisher's)")
	fs.Int(&s.cfg.BatchSize, "batch-size", "BATCH_SIZE", sink.DefaultBatchSize, "documents per bulk request at most")
	fs.Int(&s.cfg.BatchBytes, "batch-bytes", "BATCH_BYTES", sink.DefaultBatchBytes, "document bytes per bulk request at most")
	fs.Duration(&s.cfg.FlushInterval, "flush-interval", "FLUSH_INTERVAL", sink.DefaultFlushInterval, "how long a partial batch waits for more messages while another bulk is in flight (with none in flight it is sent at once, unless FLUSH_LINGER)")
	fs.Bool(&s.cfg.Linger, "flush-linger", "FLUSH_LINGER", false, "a partial batch waits FLUSH_INTERVAL even when no bulk is in flight: fewer, larger bulks at low rates, for up to FLUSH_INTERVAL more latency")
	fs.Int(&s.cfg.Lanes, "lanes", "LANES", sink.DefaultLanes, "concurrent bulk requests (a partition is in one at a time)")
	fs.Float(&s.cfg.MaxRate, "max-rate", "MAX_RATE", 0, "documents per second for the whole process (0 = no cap; 429s slow down anyway)")
	fs.Duration(&s.cfg.RetryMaxElapsed, "retry-max-elapsed", "RETRY_MAX_ELAPSED", sink.DefaultRetryMaxElapsed, "give up (exit 1, nothing committed) when a batch is refused this long")
	fs.Duration(&s.cfg.SessionTimeout, "session-timeout", "SESSION_TIMEOUT", sink.DefaultSessionTimeout, "consumer group session timeout (a dead member's partitions move after it)")
	fs.Duration(&s.cfg.HeartbeatInterval, "heartbeat-interval", "HEARTBEAT_INTERVAL", sink.DefaultHeartbeat, "consumer group heartbeat interval")
	fs.Duration(&s.cfg.DeadLetterRetention, "dead-letter-retention", "DEAD_LETTER_RETENTION", 0, "retention.ms the dead-letter topic is created with (0 = forever, retention.ms=-1)")
	fs.Int(&s.cfg.DeadLetterMaxBytes, "dead-letter-max-bytes", "DEAD_LETTER_MAX_BYTES", 0, "largest dead letter, and the dead-letter topic's max.message.bytes at creation (0 = 11 MiB; keep ≥ the topic's max.message.bytes)")
	s.metrics.RegisterMetrics(fs, "127.0.0.1:9103")
	fs.String(&s.autoCutover, "auto-cutover", "AUTO_CUTOVER", "", `comma-separated scan jobs whose rebuilt index generation goes live as soon as indexer cutover --job would accept it (needs DATABASE_URL; "" = never, cut over by hand)`)
	fs.Duration(&s.autoCutoverInterval, "auto-cutover-interval", "AUTO_CUTOVER_INTERVAL", 30*time.Second, "how often the AUTO_CUTOVER jobs' generations are checked")
	fs.Duration(&s.purge.interval, "tombstone-purge-interval", "TOMBSTONE_PURGE_INTERVAL", 0, "run indexer tombstones purge this often (0 = never; needs DATABASE_URL unless TOMBSTONE_PURGE_NO_OUTBOX)")
	s.purge.register(fs)
	fs.SecretOrFile(&s.common.DatabaseURL, "database-url", "DATABASE_URL", "PostgreSQL connection string, e.g. postgres://user:pass@localhost:5432/db (needed by AUTO_CUTOVER and TOMBSTONE_PURGE_INTERVAL; with it, index generations are created only for the processor versions jobs registered)")
	s.common.BindRequireTLS(fs)
	fs.String(&s.processorVersions, "processor-versions", "PROCESSOR_VERSIONS", "", `comma-separated processor versions (header ce_processorversion) to build index generations for, besides those jobs registered (DATABASE_URL); a record of another version is dead-lettered (unknown_processor_version) ("" and no DATABASE_URL = every version)`)
}

// validateAutoCutover checks the automatic cutover's settings before
// anything is probed.
func (s *settings) validateAutoCutover() error {
	if s.autoCutover == "" {
		return nil
	}
	switch {
	case s.common.DatabaseURL == "":
		return cli.UsageError("AUTO_CUTOVER=%s needs DATABASE_URL (the cutover checks read batch_runs and normalized_records)", s.autoCutover)
	case s.cfg.IDFormat == sink.IDFormatTypeID:
		return cli.UsageError("AUTO_CUTOVER=%s with ID_FORMAT=type:id: the cutover checks match ids to normalized_records and need ID_FORMAT=id", s.autoCutover)
	case s.autoCutoverInterval <= 0:
		return cli.UsageError("AUTO_CUTOVER_INTERVAL=%s: want > 0", s.autoCutoverInterval)
	}
	return nil
}

// load turns the parsed settings into a config and a logger, and probes
// the brokers once so a wrong credential or CA fails here, in one line.
func (s *settings) load(ctx context.Context, needEngine bool) (*slog.Logger, error) {
	logger, err := s.common.Logger()
	if err != nil {
		return nil, err
	}
	s.cfg.Logger = logger
	s.cfg.Brokers = splitList(s.brokers)
	s.cfg.AggregateTypes = splitList(s.aggregateTypes)
	s.cfg.SkipEventTypes = splitList(s.skipEventTypes)
	if s.routes != "" {
		if s.cfg.Routes, err = sink.ParseRoutes(s.routes); err != nil {
			return nil, cli.UsageError("%v", err)
		}
	}
	if !s.noKafka {
		if len(s.cfg.Brokers) == 0 {
			return nil, cli.UsageError("KAFKA_BROKERS is required (comma-separated host:port list)")
		}
		sec, err := s.kafkaSec.Build(logger)
		if err != nil {
			return nil, err
		}
		s.cfg.TLS, s.cfg.SASL = sec.TLS, sec.SASL
		if err := sec.Probe(ctx, s.cfg.Brokers); err != nil {
			return nil, err
		}
	}
	if needEngine && s.cfg.URL == "" {
		return nil, cli.UsageError("ELASTICSEARCH_URL is required (e.g. http://127.0.0.1:9200)")
	}
	if s.cfg.URL != "" {
		conn, err := s.engineSec.Build(s.cfg.URL)
		if err != nil {
			return nil, err
		}
		if needEngine {
			if err := conn.Probe(ctx, logger); err != nil {
				return nil, err
			}
		}
		s.cfg.URL, s.cfg.HTTPClient = conn.URL, conn.HTTP
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
			s.registerRecords(fs)
			s.registerRun(fs)
			s.common.RegisterLogging(fs)
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			if err := s.validateAutoCutover(); err != nil {
				return err
			}
			if err := s.purge.validate(s.common.DatabaseURL, true); err != nil {
				return err
			}
			logger, err := s.load(ctx, true)
			if err != nil {
				return err
			}
			ep, err := s.metrics.Endpoint()
			if err != nil {
				return err
			}
			reg := metrics.NewRegistry()
			s.cfg.Registerer = reg
			var pool *pgxpool.Pool
			if s.common.DatabaseURL != "" {
				if pool, err = s.common.OpenDB(ctx, 3); err != nil {
					return err
				}
				defer pool.Close()
			}
			s.checkProcessorVersions(pool)
			ix, err := sink.New(s.cfg)
			if err != nil {
				return usageIfConfig(err)
			}
			// Stopping abandons the batch in flight: it is not committed, so
			// whoever owns the partition next replays it, harmlessly.
			soft, _, stop := shutdown.Contexts(ctx, 0, logger)
			defer stop()
			health := metrics.NewHealth()
			health.AddCheck("search engine", ix.EngineReady)
			health.AddCheck("consumer group", ix.GroupReady)
			if err := metrics.Serve(soft, ep, reg, health, logger); err != nil {
				return cli.UsageError("%v", err)
			}
			if s.purge.interval > 0 {
				pCtx, pStop := context.WithCancel(soft)
				done := make(chan struct{})
				go func() {
					defer close(done)
					purgeEvery(pCtx, s.cfg, s.purge, pool, logger)
				}()
				defer func() { pStop(); <-done }()
			}
			if jobs := splitList(s.autoCutover); len(jobs) > 0 {
				acCtx, acStop := context.WithCancel(soft)
				done := make(chan struct{})
				go func() {
					defer close(done)
					_ = reconcile.AutoCutover(acCtx, s.cfg, reconcile.AutoCutoverOptions{DB: pool, Jobs: jobs, Interval: s.autoCutoverInterval, Logger: logger})
				}()
				defer func() { acStop(); <-done }()
			}
			return ix.Run(soft)
		},
	}
}

func statusCommand(stdout io.Writer) cli.Command {
	return cli.Command{
		Name:    "status",
		Summary: "print consumer lag per partition, dead-letter counts, the aliases and their index generations",
		Run: func(ctx context.Context, args []string) error {
			var s settings
			fs := cli.NewFlagSet("indexer status", "Reads the group's committed offsets and the partitions' end offsets from Kafka.\nThe aliases and their index generations (live, building, old) are shown when ELASTICSEARCH_URL\nis set; a building generation's progress against normalized_records, and the scan of the run\nbuilding it (batch_runs), when DATABASE_URL is too.")
			s.common.RegisterDatabase(fs)
			s.registerKafka(fs)
			s.registerEngine(fs)
			s.common.RegisterLogging(fs)
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			logger, err := s.load(ctx, false)
			if err != nil {
				return err
			}
			st, err := sink.GetStatus(ctx, s.cfg)
			if err != nil {
				return err
			}
			if s.common.DatabaseURL != "" && len(st.Generations) > 0 {
				// The progress of building generations is extra: without
				// it the status is still whole.
				if pool, err := s.common.OpenDB(ctx, 2); err != nil {
					logger.Warn("no generation progress: DATABASE_URL", slog.String("error", err.Error()))
				} else {
					defer pool.Close()
					if st.RowsByPV, err = sink.NormalizedRowsByPV(ctx, pool); err != nil {
						logger.Warn("no generation progress", slog.String("error", err.Error()))
					}
					if st.ScanByPV, err = sink.ScanByPV(ctx, pool); err != nil {
						logger.Warn("no scan progress", slog.String("error", err.Error()))
					}
				}
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
			var opts sink.ReplayOptions
			fs := cli.NewFlagSet("indexer dead-letter replay", "Re-publishes every dead-lettered message not replayed before, with its original key, value and\nheaders, to the topic it came from; progress is kept as offsets of group <group>.dlq-replay.\nOnly TOPIC is written to: a dead letter naming another topic is reported, not sent.")
			s.registerKafka(fs)
			s.common.RegisterLogging(fs)
			fs.String(&opts.To, "to", "", "", `send every dead letter to this topic whatever its dlq_topic header says; must be TOPIC ("" = the header's topic, which must be TOPIC)`)
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			if topic := cmp.Or(s.cfg.Topic, sink.DefaultTopic); opts.To != "" && opts.To != topic {
				return cli.UsageError("--to=%s: dead letters are replayed only to the topic this indexer consumes, TOPIC=%s", opts.To, topic)
			}
			if _, err := s.load(ctx, false); err != nil {
				return err
			}
			res, err := sink.ReplayDeadLettersWith(ctx, s.cfg, opts)
			fmt.Fprintf(stdout, "re-published %d message(s)\n", res.Republished)
			for t, n := range res.ByTopic {
				fmt.Fprintf(stdout, "  %s: %d\n", t, n)
			}
			for _, rf := range res.Refused {
				fmt.Fprintf(stdout, "  refused: partition %d offset %d names topic %q\n", rf.Partition, rf.Offset, rf.Topic)
			}
			return err
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
			fs.String(&opts.Into, "into", "", "", "the new index, e.g. records_v1_m2 (required; records_<processor version> names are generations)")
			fs.Duration(&opts.Settle, "settle", "", sink.DefaultRequestTimeout+5*time.Second, "wait after moving the write alias, for bulk requests already routed to the old index: keep it above the running indexers' REQUEST_TIMEOUT (a request they saw succeed was applied by then; one that timed out is sent again through the moved alias)")
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			if opts.Into == "" {
				return cli.UsageError("--into is required (the new index, e.g. %s_v1_m2)", s.cfg.Alias)
			}
			s.noKafka = true // reindex does not talk to Kafka
			if _, err := s.load(ctx, true); err != nil {
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
