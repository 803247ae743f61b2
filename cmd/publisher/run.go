package main

import (
	"context"
	"strings"
	"time"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/kafkaconn"
	"github.com/outboxrelay/outboxrelay/internal/metrics"
	"github.com/outboxrelay/outboxrelay/internal/shutdown"
	"github.com/outboxrelay/outboxrelay/outbox"
)

func runCommand() cli.Command {
	return cli.Command{
		Name:    "run",
		Summary: "publish outbox events to Kafka until SIGTERM/SIGINT (run as many as you like)",
		Run: func(ctx context.Context, args []string) error {
			var (
				c        cli.Common
				cfg      outbox.Config
				brokers  string
				m        cli.Metrics
				maxConns int
				listen   bool
				grace    time.Duration
				ks       kafkaconn.Settings
				topics   string
			)
			fs := cli.NewFlagSet("publisher run", "Leases outbox shards, sends their events to Kafka (acks=all, key = aggregate id),\nthen deletes them, fenced by the lease epoch. Several publishers share the 64 shards.")
			c.RegisterDatabase(fs)
			c.RegisterLogging(fs)
			fs.String(&brokers, "kafka-brokers", "KAFKA_BROKERS", "", "Kafka bootstrap brokers, comma-separated host:port (required)")
			ks.Register(fs)
			m.RegisterMetrics(fs, "127.0.0.1:9102")
			fs.String(&cfg.ID, "publisher-id", "PUBLISHER_ID", "", "name of this publisher in the lease table (default hostname-pid-random); a second process started with the id of a running one exits with an error")
			fs.Duration(&cfg.LeaseTTL, "lease-ttl", "LEASE_TTL", outbox.DefaultLeaseTTL, "shard lease lifetime; heartbeats every third of it; a dead publisher's shards move after this")
			fs.Duration(&cfg.PollInterval, "poll-interval", "POLL_INTERVAL", outbox.DefaultPollInterval, "polling fallback interval when no NOTIFY arrives (the only wake-up of idle shards with LISTEN or NOTIFY off: then consider 100ms)")
			fs.Bool(&listen, "listen", "LISTEN", true, "LISTEN for NOTIFY wake-ups and membership changes on a session connection of its own; false behind PgBouncer in transaction mode (which cannot LISTEN): polling only")
			fs.Int(&cfg.BatchSize, "batch-size", "BATCH_SIZE", outbox.DefaultBatchSize, "most events per shard per Kafka write")
			fs.Int(&cfg.BatchBytes, "batch-bytes", "BATCH_BYTES", outbox.DefaultBatchBytes, "most bytes per Kafka write; a larger event is dead-lettered (keep <= broker message.max.bytes)")
			fs.String(&cfg.Compression, "compression", "COMPRESSION", outbox.DefaultCompression, "codec of the record batches sent to Kafka: none, gzip, snappy, lz4 or zstd (consumers read any)")
			fs.Duration(&cfg.WriteTimeout, "write-timeout", "WRITE_TIMEOUT", outbox.DefaultWriteTimeout, "how long one produce attempt may write (cut to the shard's lease deadline); the broker's answer is then waited for up to as long again")
			fs.Duration(&cfg.RetryMaxElapsed, "retry-max-elapsed", "RETRY_MAX_ELAPSED", outbox.DefaultRetryMaxElapsed, "time budget of one retry loop before the shard starts over from the database")
			fs.Duration(&cfg.TopicWait, "topic-wait", "TOPIC_WAIT", outbox.DefaultTopicWait, "how long an event waits for a missing or forbidden topic before it is dead-lettered (topics are never auto-created: see topics ensure)")
			fs.String(&topics, "publisher-topics", "PUBLISHER_TOPICS", "", publisherTopicsUsage)
			fs.Duration(&cfg.Retention, "retention", "RETENTION", 0, "keep published events in outbox_published this long (0 deletes them at once)")
			fs.Duration(&cfg.BacklogInterval, "backlog-interval", "BACKLOG_INTERVAL", outbox.DefaultBacklogInterval, "refresh interval of the backlog metrics")
			fs.String(&cfg.Source, "ce-source", "CE_SOURCE", outbox.DefaultSource, "CloudEvents ce_source header")
			fs.Int(&maxConns, "database-max-conns", "DATABASE_MAX_CONNS", outbox.DefaultMaxConns, "PostgreSQL connections for shard work (one per lane, 64/N shards to a lane, each opened when first needed); the publisher holds at most this + 4: 2 for heartbeats, 1 for polling/backlog/cleanup, 1 to LISTEN")
			fs.Duration(&grace, "shutdown-grace", "SHUTDOWN_GRACE", 30*time.Second, "after the first SIGTERM/SIGINT, how long to finish batches in flight before exiting anyway")
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			var err error
			if cfg.Topics, err = parsePublisherTopics(topics); err != nil {
				return err
			}
			ep, err := m.Endpoint()
			if err != nil {
				return err
			}
			logger, err := c.Logger()
			if err != nil {
				return err
			}
			for _, b := range strings.Split(brokers, ",") {
				if b = strings.TrimSpace(b); b != "" {
					cfg.Brokers = append(cfg.Brokers, b)
				}
			}
			if len(cfg.Brokers) == 0 {
				return cli.UsageError("KAFKA_BROKERS is empty: set --kafka-brokers or KAFKA_BROKERS (e.g. localhost:9092)")
			}
			sec, err := ks.Build(logger)
			if err != nil {
				return err
			}
			cfg.TLS, cfg.SASL = sec.TLS, sec.SASL
			// Fail at start, in one line, on a wrong password or CA.
			if err := sec.Probe(ctx, cfg.Brokers); err != nil {
				return err
			}
			soft, hard, stop := shutdown.Contexts(ctx, grace, logger)
			defer stop()
			// The pool serves the start checks, polling, the backlog gauge
			// and cleanup, one query at a time; the shard lanes, heartbeats
			// and LISTEN open connections of their own from its settings.
			pool, err := c.OpenDB(hard, 1)
			if err != nil {
				return err
			}
			defer pool.Close()
			reg := metrics.NewRegistry()
			health := metrics.NewHealth()
			health.AddCheck("postgres", pool.Ping)
			cfg.Registerer, cfg.Health, cfg.Logger = reg, health, logger
			cfg.ShardConns, cfg.NoListen = maxConns, !listen
			pub, err := outbox.NewPublisher(pool, cfg)
			if err != nil {
				return cli.UsageError("%v", err)
			}
			health.AddCheck("shards", pub.Ready)
			reg.MustRegister(batch.NewRunStates(pool, logger)) // failed and abandoned runs outlive their batcher
			if err := metrics.Serve(hard, ep, reg, health, logger); err != nil {
				return cli.UsageError("%v", err)
			}
			done := make(chan error, 1)
			go func() { done <- pub.Run(soft) }()
			select {
			case err := <-done:
				return err
			case <-hard.Done():
				// Grace expired or a second signal: exit now. Batches in flight
				// were not recorded and will be sent again (at-least-once).
				return nil
			}
		},
	}
}
