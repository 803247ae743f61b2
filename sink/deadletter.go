package sink

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/outboxrelay/outboxrelay/internal/kafkakey"
)

// Headers the indexer adds to a dead-lettered message, next to the
// original key, value and headers.
const (
	HeaderDLQCode      = "dlq_error_code"   // engine error type (mapper_parsing_exception, ...) or a Code* constant
	HeaderDLQReason    = "dlq_error_reason" // the engine's or the parser's message
	HeaderDLQStatus    = "dlq_error_status" // HTTP status of the bulk item, "0" if never sent
	HeaderDLQTopic     = "dlq_topic"        // where the message came from
	HeaderDLQPartition = "dlq_partition"
	HeaderDLQOffset    = "dlq_offset"
	HeaderDLQGroup     = "dlq_group"
	HeaderDLQTime      = "dlq_time" // RFC 3339
)

type deadLetterWriter struct {
	w *kafka.Writer
}

func newDeadLetterWriter(cfg Config) *deadLetterWriter {
	return &deadLetterWriter{w: &kafka.Writer{
		Addr:         kafka.TCP(cfg.Brokers...),
		Topic:        cfg.DeadLetterTopic,
		Balancer:     kafkakey.Balancer(),
		RequiredAcks: kafka.RequireAll,
		BatchTimeout: 5 * time.Millisecond,
		MaxAttempts:  10,
	}}
}

func (w *deadLetterWriter) Close() error { return w.w.Close() }

func (w *deadLetterWriter) write(ctx context.Context, cfg Config, dead []*doc) error {
	now := time.Now().UTC().Format(time.RFC3339Nano)
	msgs := make([]kafka.Message, len(dead))
	for i, d := range dead {
		h := make([]kafka.Header, 0, len(d.msg.Headers)+8)
		for _, oh := range d.msg.Headers {
			if !strings.HasPrefix(oh.Key, "dlq_") { // a replayed message that failed again carries fresh ones
				h = append(h, oh)
			}
		}
		h = append(h,
			kafka.Header{Key: HeaderDLQCode, Value: []byte(d.poison.Code)},
			kafka.Header{Key: HeaderDLQReason, Value: []byte(d.poison.Reason)},
			kafka.Header{Key: HeaderDLQStatus, Value: []byte(strconv.Itoa(d.poison.Status))},
			kafka.Header{Key: HeaderDLQTopic, Value: []byte(d.msg.Topic)},
			kafka.Header{Key: HeaderDLQPartition, Value: []byte(strconv.Itoa(d.msg.Partition))},
			kafka.Header{Key: HeaderDLQOffset, Value: []byte(strconv.FormatInt(d.msg.Offset, 10))},
			kafka.Header{Key: HeaderDLQGroup, Value: []byte(cfg.Group)},
			kafka.Header{Key: HeaderDLQTime, Value: []byte(now)},
		)
		msgs[i] = kafka.Message{Key: d.msg.Key, Value: d.msg.Value, Headers: h}
	}
	// The batch's offsets are committed only after this returns, so a
	// failure here loses nothing: the batch is replayed.
	if err := w.w.WriteMessages(context.WithoutCancel(ctx), msgs...); err != nil {
		return fmt.Errorf("write %d message(s) to dead-letter topic %s: %w", len(msgs), cfg.DeadLetterTopic, err)
	}
	return nil
}

// ReplayGroup is the consumer group whose committed offsets on the
// dead-letter topic mark what `dead-letter replay` has re-published.
func ReplayGroup(cfg Config) string { return cfg.withDefaults().Group + ".dlq-replay" }

// ReplayResult says what [ReplayDeadLetters] re-published.
type ReplayResult struct {
	Republished int
	ByTopic     map[string]int
}

// ReplayDeadLetters re-publishes every dead-lettered message not replayed
// before to the topic it came from (header dlq_topic), with its original
// key, value and headers, and records its progress as committed offsets of
// [ReplayGroup]. It stops at the end offsets seen when it starts. Run it
// after fixing the cause (a mapping, the document); a message that fails
// again is dead-lettered again with fresh error headers.
func ReplayDeadLetters(ctx context.Context, cfg Config) (ReplayResult, error) {
	cfg = cfg.withDefaults()
	res := ReplayResult{ByTopic: map[string]int{}}
	c := &kafka.Client{Addr: kafka.TCP(cfg.Brokers...), Timeout: 30 * time.Second}
	group := ReplayGroup(cfg)
	offs, err := topicOffsets(ctx, c, cfg.DeadLetterTopic, group)
	if err != nil {
		return res, err
	}
	w := &kafka.Writer{
		// The publisher's partitioner: a replayed key joins its other events.
		Addr: kafka.TCP(cfg.Brokers...), Balancer: kafkakey.Balancer(), RequiredAcks: kafka.RequireAll,
		BatchTimeout: 5 * time.Millisecond, MaxAttempts: 10,
	}
	defer w.Close()
	for _, po := range offs {
		from := po.Committed
		if from < po.First {
			from = po.First
		}
		if from >= po.End {
			continue
		}
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: cfg.Brokers, Topic: cfg.DeadLetterTopic, Partition: po.Partition, MaxWait: 250 * time.Millisecond})
		if err := r.SetOffset(from); err != nil {
			r.Close()
			return res, err
		}
		var out []kafka.Message
		last := from - 1
		for last < po.End-1 {
			m, err := r.FetchMessage(ctx)
			if err != nil {
				r.Close()
				return res, fmt.Errorf("read %s/%d: %w", cfg.DeadLetterTopic, po.Partition, err)
			}
			last = m.Offset
			topic, _ := header(m, HeaderDLQTopic)
			if topic == "" {
				topic = cfg.Topic
			}
			var h []kafka.Header
			for _, mh := range m.Headers {
				if !strings.HasPrefix(mh.Key, "dlq_") {
					h = append(h, mh)
				}
			}
			out = append(out, kafka.Message{Topic: topic, Key: m.Key, Value: m.Value, Headers: h})
			res.ByTopic[topic]++
		}
		r.Close()
		if err := w.WriteMessages(ctx, out...); err != nil {
			return res, fmt.Errorf("re-publish %d dead-lettered message(s): %w", len(out), err)
		}
		res.Republished += len(out)
		cr, err := c.OffsetCommit(ctx, &kafka.OffsetCommitRequest{
			GroupID: group, GenerationID: -1,
			Topics: map[string][]kafka.OffsetCommit{cfg.DeadLetterTopic: {{Partition: po.Partition, Offset: last + 1}}},
		})
		if err == nil {
			for _, p := range cr.Topics[cfg.DeadLetterTopic] {
				err = cmp.Or(err, p.Error)
			}
		}
		if err != nil {
			return res, fmt.Errorf("record replay progress of %s/%d: %w", cfg.DeadLetterTopic, po.Partition, err)
		}
		cfg.Logger.Info("dead letters re-published", slog.Int("partition", po.Partition), slog.Int("messages", len(out)))
	}
	return res, nil
}
