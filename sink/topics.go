package sink

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/segmentio/kafka-go"
)

// The Kafka topic helpers: creating a topic and reading its partitions and
// offsets (status, replay, tests).

// ensureTopicVia creates topic through rt (the configured TLS and SASL:
// Config.kafkaTransport) with the broker's default replication and the
// given topic configs when it does not exist. An existing topic is left as
// it is.
func ensureTopicVia(ctx context.Context, rt kafka.RoundTripper, brokers []string, topic string, partitions int, configs ...kafka.ConfigEntry) error {
	c := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 30 * time.Second, Transport: rt}
	res, err := c.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{
		Topic: topic, NumPartitions: partitions, ReplicationFactor: -1, ConfigEntries: configs,
	}}})
	if err != nil {
		return fmt.Errorf("create topic %s: %w", topic, err)
	}
	if err := res.Errors[topic]; err != nil && !errors.Is(err, kafka.TopicAlreadyExists) {
		return fmt.Errorf("create topic %s: %w", topic, err)
	}
	return nil
}

// topicConfig returns the values of the named configs of topic.
func topicConfig(ctx context.Context, c *kafka.Client, topic string, names ...string) (map[string]string, error) {
	entries, err := topicConfigEntries(ctx, c, topic, names...)
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for name, e := range entries {
		out[name] = e.ConfigValue
	}
	return out, nil
}

// topicConfigEntries returns the named configs of topic with their source.
func topicConfigEntries(ctx context.Context, c *kafka.Client, topic string, names ...string) (map[string]kafka.DescribeConfigResponseConfigEntry, error) {
	res, err := c.DescribeConfigs(ctx, &kafka.DescribeConfigsRequest{Resources: []kafka.DescribeConfigRequestResource{{
		ResourceType: kafka.ResourceTypeTopic, ResourceName: topic, ConfigNames: names,
	}}})
	if err != nil {
		return nil, fmt.Errorf("describe configs of topic %s: %w", topic, err)
	}
	out := map[string]kafka.DescribeConfigResponseConfigEntry{}
	for _, r := range res.Resources {
		if r.Error != nil {
			return nil, fmt.Errorf("describe configs of topic %s: %w", topic, r.Error)
		}
		for _, e := range r.ConfigEntries {
			out[e.ConfigName] = e
		}
	}
	return out, nil
}

// configSourceTopic is DescribeConfigs' DYNAMIC_TOPIC_CONFIG: a value set
// on the topic itself, not inherited from the broker.
const configSourceTopic = 1

// setOnTopic reports whether a config's value was set on the topic.
func setOnTopic(e kafka.DescribeConfigResponseConfigEntry) bool {
	if e.ConfigSource == 0 { // DescribeConfigs v0: no source
		return !e.IsDefault
	}
	return e.ConfigSource == configSourceTopic
}

// setTopicConfigs sets configs on topic.
func setTopicConfigs(ctx context.Context, c *kafka.Client, topic string, configs []kafka.ConfigEntry) error {
	req := kafka.IncrementalAlterConfigsRequestResource{ResourceType: kafka.ResourceTypeTopic, ResourceName: topic}
	for _, e := range configs {
		req.Configs = append(req.Configs, kafka.IncrementalAlterConfigsRequestConfig{Name: e.ConfigName, Value: e.ConfigValue, ConfigOperation: kafka.ConfigOperationSet})
	}
	res, err := c.IncrementalAlterConfigs(ctx, &kafka.IncrementalAlterConfigsRequest{Resources: []kafka.IncrementalAlterConfigsRequestResource{req}})
	if err == nil {
		for _, r := range res.Resources {
			err = cmp.Or(err, r.Error)
		}
	}
	if err != nil {
		return fmt.Errorf("set configs of topic %s: %w", topic, err)
	}
	return nil
}

// topicPartitions lists the partition ids of topic.
func topicPartitions(ctx context.Context, c *kafka.Client, topic string) ([]int, error) {
	md, err := c.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return nil, fmt.Errorf("metadata of %s: %w", topic, err)
	}
	for _, t := range md.Topics {
		if t.Name != topic {
			continue
		}
		if t.Error != nil {
			return nil, fmt.Errorf("metadata of %s: %w", topic, t.Error)
		}
		ids := make([]int, len(t.Partitions))
		for i, p := range t.Partitions {
			ids[i] = p.ID
		}
		return ids, nil
	}
	return nil, fmt.Errorf("metadata of %s: %w", topic, kafka.UnknownTopicOrPartition)
}

// PartitionOffsets is one partition as a consumer group sees it.
type PartitionOffsets struct {
	Partition int
	First     int64 // oldest offset still in the log
	End       int64 // high watermark: the next offset to be written
	// Committed is the group's committed offset, -1 when it has none.
	Committed int64
}

// Lag is how many messages the group has not resolved yet.
func (p PartitionOffsets) Lag() int64 {
	from := p.Committed
	if from < p.First {
		from = p.First // a group without a commit starts at the earliest offset
	}
	return max(p.End-from, 0)
}

// topicOffsets returns first, end and committed offsets of every partition
// of topic for group.
func topicOffsets(ctx context.Context, c *kafka.Client, topic, group string) ([]PartitionOffsets, error) {
	ids, err := topicPartitions(ctx, c, topic)
	if err != nil {
		return nil, err
	}
	reqs := make([]kafka.OffsetRequest, 0, 2*len(ids))
	for _, id := range ids {
		reqs = append(reqs, kafka.FirstOffsetOf(id), kafka.LastOffsetOf(id))
	}
	lo, err := c.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: reqs}})
	if err != nil {
		return nil, fmt.Errorf("list offsets of %s: %w", topic, err)
	}
	byID := map[int]*PartitionOffsets{}
	out := make([]PartitionOffsets, len(ids))
	for i, id := range ids {
		out[i] = PartitionOffsets{Partition: id, Committed: -1}
		byID[id] = &out[i]
	}
	for _, po := range lo.Topics[topic] {
		if po.Error != nil {
			return nil, fmt.Errorf("list offsets of %s/%d: %w", topic, po.Partition, po.Error)
		}
		if p := byID[po.Partition]; p != nil {
			p.First, p.End = po.FirstOffset, po.LastOffset
		}
	}
	of, err := c.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: ids}})
	if err != nil {
		return nil, fmt.Errorf("committed offsets of group %s: %w", group, err)
	}
	if of.Error != nil {
		return nil, fmt.Errorf("committed offsets of group %s: %w", group, of.Error)
	}
	for _, p := range of.Topics[topic] {
		if p.Error != nil {
			return nil, fmt.Errorf("committed offset of group %s on %s/%d: %w", group, topic, p.Partition, p.Error)
		}
		if q := byID[p.Partition]; q != nil {
			q.Committed = p.CommittedOffset
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Partition < out[j].Partition })
	return out, nil
}

func isUnknownTopic(err error) bool { return errors.Is(err, kafka.UnknownTopicOrPartition) }
