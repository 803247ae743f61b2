package outbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"
)

// TopicSpec is a topic as [EnsureTopics] creates it.
type TopicSpec struct {
	Name string
	// Partitions is the partition count. Required (> 0): a key's partition
	// is its hash modulo this count, so changing it later moves keys and
	// breaks their order across the change.
	Partitions int
	// ReplicationFactor is the number of replicas. Required (> 0).
	ReplicationFactor int
}

// TopicResult is what [EnsureTopics] found or did for one topic.
type TopicResult struct {
	Name       string
	Created    bool // false: it existed already
	Partitions int  // the topic's partition count now
	// Err is set when the topic could not be created, or exists with
	// another partition count than asked for (it is left as it is).
	Err error
}

// ErrTopicMismatch is wrapped in a TopicResult.Err of a topic that exists
// with another partition count.
var ErrTopicMismatch = errors.New("topic exists with another partition count")

// EnsureTopics creates the topics that do not exist yet, with the given
// partition count and replication factor, and checks the partition count of
// those that do. The publisher never creates topics itself (an event for a
// missing topic waits Config.TopicWait, then goes to outbox_dead_letters):
// run this (`publisher topics ensure`) when a deployment adds a topic. It
// returns an error only when the brokers cannot be asked at all; per-topic
// problems are in the results.
//
// transport carries TLS and SASL (kafkaconn's Security.Transport); nil is
// a plaintext connection.
func EnsureTopics(ctx context.Context, transport kafka.RoundTripper, brokers []string, specs []TopicSpec) ([]TopicResult, error) {
	if err := validateTopicSpecs(specs); err != nil {
		return nil, err
	}
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 30 * time.Second, Transport: transport}
	req := &kafka.CreateTopicsRequest{}
	for _, s := range specs {
		req.Topics = append(req.Topics, kafka.TopicConfig{Topic: s.Name, NumPartitions: s.Partitions, ReplicationFactor: s.ReplicationFactor})
	}
	resp, err := client.CreateTopics(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("create topics on %v: %w", brokers, err)
	}
	names := make([]string, len(specs))
	for i, s := range specs {
		names[i] = s.Name
	}
	// Topic creation is asynchronous: wait (bounded) until the metadata
	// shows every topic with its partitions and their leaders.
	var meta *kafka.MetadataResponse
	for attempt := 0; ; attempt++ {
		meta, err = client.Metadata(ctx, &kafka.MetadataRequest{Topics: names})
		if err == nil && allPresent(meta, names) || attempt == 50 || ctx.Err() != nil {
			break
		}
		if !sleep(ctx, 200*time.Millisecond) {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("read topic metadata from %v: %w", brokers, err)
	}
	out := make([]TopicResult, len(specs))
	for i, s := range specs {
		r := TopicResult{Name: s.Name}
		cerr := resp.Errors[s.Name]
		switch {
		case cerr == nil:
			r.Created = true
		case errors.Is(cerr, kafka.TopicAlreadyExists):
		default:
			r.Err = fmt.Errorf("create topic %s: %w", s.Name, cerr)
		}
		for _, t := range meta.Topics {
			if t.Name == s.Name && t.Error == nil {
				r.Partitions = len(t.Partitions)
			}
		}
		if r.Err == nil && r.Partitions != s.Partitions {
			r.Err = fmt.Errorf("%w: %s has %d partitions, %d asked for (left as it is: changing the count moves keys to other partitions)",
				ErrTopicMismatch, s.Name, r.Partitions, s.Partitions)
		}
		out[i] = r
	}
	return out, nil
}

// allPresent reports whether every topic is in the metadata with its
// partitions, each with a leader: a producer that starts right after
// `topics ensure` must not meet UNKNOWN_TOPIC_OR_PARTITION or
// LEADER_NOT_AVAILABLE while the brokers create the partitions.
func allPresent(meta *kafka.MetadataResponse, names []string) bool {
	found := 0
	for _, t := range meta.Topics {
		if t.Error != nil || len(t.Partitions) == 0 {
			continue
		}
		ready := true
		for _, p := range t.Partitions {
			if p.Error != nil || p.Leader.Host == "" {
				ready = false
			}
		}
		if ready {
			found++
		}
	}
	return found == len(names)
}

// ParseTopicSpecs parses a topic list such as "orders:12:3,users:6:3"
// (name:partitions:replication factor, comma-separated), the form of
// Config.Topics in PUBLISHER_TOPICS. "" is nil: no list.
func ParseTopicSpecs(s string) ([]TopicSpec, error) {
	var specs []TopicSpec
	for _, item := range strings.Split(s, ",") {
		if item = strings.TrimSpace(item); item == "" {
			continue
		}
		f := strings.Split(item, ":")
		if len(f) != 3 {
			return nil, fmt.Errorf("%q is not name:partitions:replication (e.g. orders:12:3)", item)
		}
		spec := TopicSpec{Name: strings.TrimSpace(f[0])}
		var err error
		if spec.Partitions, err = strconv.Atoi(strings.TrimSpace(f[1])); err != nil {
			return nil, fmt.Errorf("%q: partitions %q is not a number", item, f[1])
		}
		if spec.ReplicationFactor, err = strconv.Atoi(strings.TrimSpace(f[2])); err != nil {
			return nil, fmt.Errorf("%q: replication factor %q is not a number", item, f[2])
		}
		specs = append(specs, spec)
	}
	if err := validateTopicSpecs(specs); err != nil {
		return nil, err
	}
	return specs, nil
}

func validateTopicSpecs(specs []TopicSpec) error {
	seen := map[string]bool{}
	for _, s := range specs {
		switch {
		case s.Name == "":
			return fmt.Errorf("topic name is empty")
		case seen[s.Name]:
			return fmt.Errorf("topic %s is listed twice", s.Name)
		case s.Partitions <= 0:
			return fmt.Errorf("topic %s: partitions=%d: must be > 0", s.Name, s.Partitions)
		case s.ReplicationFactor <= 0:
			return fmt.Errorf("topic %s: replication factor %d: must be > 0", s.Name, s.ReplicationFactor)
		}
		seen[s.Name] = true
	}
	return nil
}
