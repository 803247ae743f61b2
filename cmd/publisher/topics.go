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
			var brokers, topics, list string
			var partitions, replication int
			fs := cli.NewFlagSet("publisher topics ensure", "Creates the topics of PUBLISHER_TOPICS (each with its own partition count and replication),\n"+
				"or the --topics given with --partitions and --replication-factor, when they do not exist, and checks\n"+
				"the partition count of those that do. The publisher never creates topics: an event for a missing\n"+
				"topic (or one not in PUBLISHER_TOPICS, when set) waits TOPIC_WAIT, then goes to the dead letters.")
			fs.String(&brokers, "kafka-brokers", "KAFKA_BROKERS", "", "Kafka bootstrap brokers, comma-separated host:port (required)")
			fs.String(&list, "publisher-topics", "PUBLISHER_TOPICS", "", `the topics to create, name:partitions:replication comma-separated, e.g. "orders:12:3,users:6:3" (the publisher's list; instead of --topics)`)
			fs.String(&topics, "topics", "TOPICS", "", "comma-separated topic names (instead of PUBLISHER_TOPICS)")
			fs.Int(&partitions, "partitions", "TOPIC_PARTITIONS", 0, "partition count of the --topics (required with them; changing it later moves keys)")
			fs.Int(&replication, "replication-factor", "TOPIC_REPLICATION_FACTOR", 0, "replication factor of the --topics (required with them; 3 on a production cluster)")
			var ks kafkaconn.Settings
			ks.Register(fs)
			if _, err := fs.Parse(args); err != nil {
				return err
			}
			specs, err := parsePublisherTopics(list)
			if err != nil {
				return err
			}
			if specs != nil && strings.TrimSpace(topics) != "" {
				return cli.UsageError("PUBLISHER_TOPICS and TOPICS (--topics) are both set: give one")
			}
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
				return cli.UsageError("no topics: set PUBLISHER_TOPICS, or --topics with --partitions and --replication-factor")
			case list == "" && partitions <= 0:
				return cli.UsageError("--partitions=%d: must be > 0", partitions)
			case list == "" && replication <= 0:
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

const publisherTopicsUsage = `the only topics to write to, name:partitions:replication comma-separated, e.g. "orders:12:3,users:6:3" (what topics ensure creates); an event of another topic is dead-lettered after TOPIC_WAIT ("" = any topic the broker has)`

// parsePublisherTopics parses PUBLISHER_TOPICS; "" is nil (no list).
func parsePublisherTopics(s string) ([]outbox.TopicSpec, error) {
	specs, err := outbox.ParseTopicSpecs(s)
	if err != nil {
		return nil, cli.UsageError("PUBLISHER_TOPICS=%q: %v", s, err)
	}
	return specs, nil
}
