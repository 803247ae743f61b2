package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"text/tabwriter"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/kafkaconn"
	"github.com/outboxrelay/outboxrelay/outbox"
	"github.com/segmentio/kafka-go"
)

func topicsEnsureCommand(stdout io.Writer) cli.Command {
	return cli.Command{
		Name:    "topics ensure",
		Summary: "create the topics the outbox writes to, with an explicit partition count and replication",
		Run: func(ctx context.Context, args []string) error {
			var brokers, topics string
			var partitions, replication int
			fs := cli.NewFlagSet("publisher topics ensure", "Creates the given topics when they do not exist and checks the partition count of those that do.\nThe publisher never creates topics: an event for a missing topic waits TOPIC_WAIT, then\ngoes to the dead letters.")
			fs.String(&brokers, "kafka-brokers", "KAFKA_BROKERS", "", "Kafka bootstrap brokers, comma-separated host:port (required)")
			fs.String(&topics, "topics", "TOPICS", "", "comma-separated topic names (required)")
			fs.Int(&partitions, "partitions", "TOPIC_PARTITIONS", 0, "partition count of new topics (required; changing it later moves keys)")
			fs.Int(&replication, "replication-factor", "TOPIC_REPLICATION_FACTOR", 0, "replication factor of new topics (required; 3 on a production cluster)")
			var ks kafkaconn.Settings
			ks.Register(fs)
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			var specs []outbox.TopicSpec
			for _, t := range strings.Split(topics, ",") {
				if t = strings.TrimSpace(t); t != "" {
					specs = append(specs, outbox.TopicSpec{Name: t, Partitions: partitions, ReplicationFactor: replication})
				}
			}
			var brokerList []string
			for _, b := range strings.Split(brokers, ",") {
				if b = strings.TrimSpace(b); b != "" {
					brokerList = append(brokerList, b)
				}
			}
			switch {
			case len(brokerList) == 0:
				return cli.UsageError("KAFKA_BROKERS is empty: set --kafka-brokers or KAFKA_BROKERS")
			case len(specs) == 0:
				return cli.UsageError("--topics is empty: name the topics to create")
			case partitions <= 0:
				return cli.UsageError("--partitions=%d: must be > 0", partitions)
			case replication <= 0:
				return cli.UsageError("--replication-factor=%d: must be > 0", replication)
			}
			sec, err := ks.Build(slog.Default())
			if err != nil {
				return err
			}
			if err := sec.Probe(ctx, brokerList); err != nil {
				return err
			}
			var transport kafka.RoundTripper
			if sec != nil && (sec.TLS != nil || sec.SASL != nil) {
				transport = sec.Transport(&kafka.Transport{})
			}
			results, err := outbox.EnsureTopics(ctx, transport, brokerList, specs)
			if err != nil {
				return err
			}
			tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "TOPIC\tPARTITIONS\tRESULT")
			var errs []error
			for _, r := range results {
				result := "exists"
				switch {
				case r.Err != nil:
					result, errs = r.Err.Error(), append(errs, r.Err)
				case r.Created:
					result = "created"
				}
				fmt.Fprintf(tw, "%s\t%d\t%s\n", r.Name, r.Partitions, result)
			}
			if err := tw.Flush(); err != nil {
				return err
			}
			return errors.Join(errs...)
		},
	}
}
