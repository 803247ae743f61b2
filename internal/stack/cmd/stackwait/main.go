// Command stackwait is the readiness probe and small helper used by the
// native test-stack scripts under scripts/stack (no Docker).
//
// Usage:
//
//	stackwait kafka <host:port> [timeout]   wait until a Kafka broker answers
//
// timeout is a Go duration ("90s") or a number of seconds ("90"); default 60s.
// Exit status 0 means ready; 1 means not ready before the timeout (the last
// error is printed on stderr); 2 means bad usage.
//
// Modes are dispatched on os.Args[1]; add new ones (opensearch, postgres, …)
// to the switch in main.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/segmentio/kafka-go"
)

const defaultTimeout = 60 * time.Second

// STACKWAIT_DEBUG=1 logs every attempt on stderr.
var debug = os.Getenv("STACKWAIT_DEBUG") != ""

func usage() {
	fmt.Fprintln(os.Stderr, `usage:
  stackwait kafka <host:port> [timeout]`)
	os.Exit(2)
}

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "kafka":
		if len(os.Args) < 3 || len(os.Args) > 4 {
			usage()
		}
		timeout := defaultTimeout
		if len(os.Args) == 4 {
			timeout = parseTimeout(os.Args[3])
		}
		err = waitLoop("kafka", timeout, func(ctx context.Context) error {
			return probeKafka(ctx, os.Args[2])
		})
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "stackwait %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

func parseTimeout(s string) time.Duration {
	if d, err := time.ParseDuration(s); err == nil && d > 0 {
		return d
	}
	if n, err := strconv.ParseFloat(s, 64); err == nil && n > 0 {
		return time.Duration(n * float64(time.Second))
	}
	fmt.Fprintf(os.Stderr, "stackwait: bad timeout %q\n", s)
	os.Exit(2)
	return 0
}

// waitLoop calls probe until it succeeds or timeout elapses. Each attempt gets
// its own bounded context so a hung connection cannot eat the whole budget.
func waitLoop(what string, timeout time.Duration, probe func(context.Context) error) error {
	deadline := time.Now().Add(timeout)
	var last error
	for attempt := 1; ; attempt++ {
		remaining := time.Until(deadline)
		if remaining <= 0 {
			return fmt.Errorf("%s not ready after %s (%d attempts): %w", what, timeout, attempt-1, last)
		}
		per := 10 * time.Second
		if remaining < per {
			per = remaining
		}
		ctx, cancel := context.WithTimeout(context.Background(), per)
		t0 := time.Now()
		last = probe(ctx)
		cancel()
		if debug {
			fmt.Fprintf(os.Stderr, "stackwait %s: attempt %d (%s): %v\n", what, attempt, time.Since(t0).Round(time.Millisecond), last)
		}
		if last == nil {
			return nil
		}
		if time.Until(deadline) <= 0 {
			continue
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// probeKafka checks that the broker answers metadata, that a topic can be
// created and gets a leader, that a record is accepted with acks=all, and that
// a group coordinator is available (the first FindCoordinator makes the broker
// create __consumer_offsets, so consumer-group tests do not pay for it later).
// The throwaway topic is deleted at the end.
func probeKafka(ctx context.Context, addr string) error {
	// A fresh Transport per attempt: its cached cluster metadata must not
	// outlive a broker that was still starting.
	transport := &kafka.Transport{DialTimeout: 3 * time.Second}
	defer transport.CloseIdleConnections()
	client := &kafka.Client{Addr: kafka.TCP(addr), Timeout: 10 * time.Second, Transport: transport}

	md, err := client.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{}})
	if err != nil {
		return fmt.Errorf("metadata: %w", err)
	}
	if len(md.Brokers) == 0 {
		return errors.New("metadata: no brokers registered yet")
	}

	topic := "_stackwait-" + randHex(6)
	ct, err := client.CreateTopics(ctx, &kafka.CreateTopicsRequest{
		Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: 1, ReplicationFactor: -1}}, // the broker default: a cluster is ready when acks=all works at its replication
	})
	if err != nil {
		return fmt.Errorf("create topic: %w", err)
	}
	if e := ct.Errors[topic]; e != nil && !errors.Is(e, kafka.TopicAlreadyExists) {
		return fmt.Errorf("create topic: %w", e)
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, _ = client.DeleteTopics(dctx, &kafka.DeleteTopicsRequest{Topics: []string{topic}})
	}()

	// Wait (within ctx) for the new partition to have a leader.
	for {
		md, err = client.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
		if err == nil && len(md.Topics) == 1 && md.Topics[0].Error == nil &&
			len(md.Topics[0].Partitions) == 1 && md.Topics[0].Partitions[0].Leader.Port != 0 {
			break
		}
		if ctx.Err() != nil {
			return fmt.Errorf("topic %s has no leader: %v", topic, err)
		}
		time.Sleep(100 * time.Millisecond)
	}

	pr, err := client.Produce(ctx, &kafka.ProduceRequest{
		Topic:        topic,
		Partition:    0,
		RequiredAcks: kafka.RequireAll,
		Records:      kafka.NewRecordReader(kafka.Record{Value: kafka.NewBytes([]byte("ping"))}),
	})
	if err != nil {
		return fmt.Errorf("produce: %w", err)
	}
	if pr.Error != nil {
		return fmt.Errorf("produce: %w", pr.Error)
	}

	fc, err := client.FindCoordinator(ctx, &kafka.FindCoordinatorRequest{
		Key:     "stackwait",
		KeyType: kafka.CoordinatorKeyTypeConsumer,
	})
	if err != nil {
		return fmt.Errorf("find coordinator: %w", err)
	}
	if fc.Error != nil {
		return fmt.Errorf("find coordinator: %w", fc.Error)
	}
	return nil
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
