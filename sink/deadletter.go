package sink

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/cenkalti/backoff/v4"
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
	// written is poked after every write, for the dead-letter gauges.
	written chan struct{}
}

func newDeadLetterWriter(cfg Config) *deadLetterWriter {
	return &deadLetterWriter{written: make(chan struct{}, 1), w: &kafka.Writer{
		Addr:         kafka.TCP(cfg.Brokers...),
		Topic:        cfg.DeadLetterTopic,
		Balancer:     kafkakey.Balancer(),
		RequiredAcks: kafka.RequireAll,
		BatchTimeout: 5 * time.Millisecond,
		// A dead letter is as large as the message it holds: kafka-go's
		// default (1 MiB) refuses larger ones before sending, and the
		// indexer would stop. The topic is created to take this much.
		BatchBytes:   int64(cfg.DeadLetterMaxBytes),
		WriteTimeout: cfg.RequestTimeout,
		// write retries with backoff, which stops when the run ends;
		// kafka-go's own retries would not.
		MaxAttempts: 1,
		Transport:   cfg.kafkaTransport(),
	}}
}

func (w *deadLetterWriter) Close() error { return w.w.Close() }

// write sends dead to the dead-letter topic, retrying within the retry
// budget. The batch's offsets are committed only after it returns, so a
// failure loses nothing: the batch is replayed (and a dead letter written
// by an attempt that then failed is written again, which replay handles).
// It returns as soon as ctx ends: shutdown never waits on the broker.
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
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = cfg.RetryInitial, cfg.RetryMax, cfg.RetryMaxElapsed
	attempt := 0
	err := backoff.RetryNotify(func() error {
		attempt++
		err := w.w.WriteMessages(ctx, msgs...)
		var werrs kafka.WriteErrors
		if errors.As(err, &werrs) {
			failed := msgs[:0:0]
			for i, e := range werrs {
				if e != nil {
					failed = append(failed, msgs[i])
				}
				if dlqPermanent(e) {
					return backoff.Permanent(e)
				}
			}
			msgs = failed // the others are written
		}
		if dlqPermanent(err) {
			return backoff.Permanent(err)
		}
		return err
	}, backoff.WithContext(b, ctx), func(err error, next time.Duration) {
		cfg.Logger.Warn("dead-letter write failed; retrying", slog.String("topic", cfg.DeadLetterTopic),
			slog.Int("messages", len(msgs)), slog.Int("attempt", attempt), slog.Duration("next", next), slog.String("error", err.Error()))
	})
	select {
	case w.written <- struct{}{}:
	default:
	}
	if err != nil {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		if dlqPermanent(err) {
			return fmt.Errorf("write %d message(s) to dead-letter topic %s (DEAD_LETTER_MAX_BYTES=%d; the topic's max.message.bytes must be as large): %w",
				len(msgs), cfg.DeadLetterTopic, cfg.DeadLetterMaxBytes, err)
		}
		return fmt.Errorf("write %d message(s) to dead-letter topic %s: %w", len(msgs), cfg.DeadLetterTopic, err)
	}
	return nil
}

// dlqPermanent: a message too large for the writer or the topic.
func dlqPermanent(err error) bool {
	var tooLarge kafka.MessageTooLargeError
	return errors.As(err, &tooLarge) || errors.Is(err, kafka.MessageSizeTooLarge)
}

// deadLetterTopicConfigs are the configs the dead-letter topic is created
// with: it keeps its messages for DeadLetterRetention (forever by
// default), because the main topic's offsets are committed once they are
// written, and takes messages as large as the writer sends.
func deadLetterTopicConfigs(cfg Config) []kafka.ConfigEntry {
	retention := int64(-1)
	if cfg.DeadLetterRetention > 0 {
		retention = cfg.DeadLetterRetention.Milliseconds()
	}
	return []kafka.ConfigEntry{
		{ConfigName: "retention.ms", ConfigValue: strconv.FormatInt(retention, 10)},
		{ConfigName: "max.message.bytes", ConfigValue: strconv.Itoa(cfg.DeadLetterMaxBytes)},
	}
}

// ensureDeadLetterTopic creates the dead-letter topic when missing. On an
// existing one, a config the topic inherits from the broker (a topic an
// older indexer created: 7-day retention, 1 MiB messages) is set to the
// indexer's; a config set on the topic is the operator's and stays, with a
// warning when it differs.
func (ix *Indexer) ensureDeadLetterTopic(ctx context.Context) error {
	topic := ix.cfg.DeadLetterTopic
	want := deadLetterTopicConfigs(ix.cfg)
	if err := ensureTopicVia(ctx, ix.cfg.kafkaTransport(), ix.cfg.Brokers, topic, 1, want...); err != nil {
		return err
	}
	c := &kafka.Client{Addr: kafka.TCP(ix.cfg.Brokers...), Timeout: 30 * time.Second, Transport: ix.cfg.kafkaTransport()}
	names := make([]string, len(want))
	for i, e := range want {
		names[i] = e.ConfigName
	}
	// A topic created a moment ago may not be described yet by the broker
	// asked (its metadata is still on its way): try a few times.
	var have map[string]kafka.DescribeConfigResponseConfigEntry
	var err error
	for attempt := 1; ; attempt++ {
		if have, err = topicConfigEntries(ctx, c, topic, names...); err == nil || attempt == 5 || ctx.Err() != nil {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(attempt) * 200 * time.Millisecond):
		}
	}
	if err != nil {
		ix.log.Warn("cannot read the dead-letter topic's configs", slog.String("topic", topic), slog.String("error", err.Error()))
		return nil
	}
	var set []kafka.ConfigEntry
	for _, e := range want {
		h, ok := have[e.ConfigName]
		switch {
		case !ok || h.ConfigValue == e.ConfigValue:
		case !setOnTopic(h):
			set = append(set, e)
		default:
			ix.log.Warn("dead-letter topic config set on the topic differs from the indexer's setting; dead letters may expire or be refused",
				slog.String("topic", topic), slog.String("config", e.ConfigName),
				slog.String("topic_value", h.ConfigValue), slog.String("wanted", e.ConfigValue))
		}
	}
	if len(set) > 0 {
		if err := setTopicConfigs(ctx, c, topic, set); err != nil {
			// Not allowed to (ACLs), say: the warning is what is left.
			ix.log.Warn("cannot set the dead-letter topic's configs; dead letters may expire or be refused",
				slog.String("topic", topic), slog.String("error", err.Error()))
			set = nil
		}
		for _, e := range set {
			ix.log.Info("dead-letter topic config set", slog.String("topic", topic), slog.String("config", e.ConfigName),
				slog.String("was", have[e.ConfigName].ConfigValue), slog.String("value", e.ConfigValue))
			have[e.ConfigName] = kafka.DescribeConfigResponseConfigEntry{ConfigName: e.ConfigName, ConfigValue: e.ConfigValue}
		}
	}
	// A topic that takes less (set by hand) bounds the writer's batches
	// too, or a batch of small dead letters would be refused as a whole.
	// No write has happened yet: Run calls this first.
	if n, err := strconv.Atoi(have["max.message.bytes"].ConfigValue); err == nil && n > 0 && int64(n) < ix.dlq.w.BatchBytes {
		ix.dlq.w.BatchBytes = int64(n)
	}
	return nil
}

// deadLetterRefresh is how often the dead-letter gauges are read from the
// broker besides after every write (a replay lowers pending).
const deadLetterRefresh = 30 * time.Second

// watchDeadLetters keeps the indexer_dead_letter_topic_messages gauges
// current until ctx ends.
func (ix *Indexer) watchDeadLetters(ctx context.Context) {
	c := &kafka.Client{Addr: kafka.TCP(ix.cfg.Brokers...), Timeout: 15 * time.Second, Transport: ix.cfg.kafkaTransport()}
	tick := time.NewTicker(deadLetterRefresh)
	defer tick.Stop()
	for {
		stored, pending, err := deadLetterCounts(ctx, c, ix.cfg)
		if err == nil {
			ix.m.deadLetterTopic.WithLabelValues("stored").Set(float64(stored))
			ix.m.deadLetterTopic.WithLabelValues("pending").Set(float64(pending))
		} else if ctx.Err() == nil {
			ix.log.Warn("cannot read the dead-letter topic's offsets", slog.String("topic", ix.cfg.DeadLetterTopic), slog.String("error", err.Error()))
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-ix.dlq.written:
		}
	}
}

// ReplayGroup is the consumer group whose committed offsets on the
// dead-letter topic mark what `dead-letter replay` has re-published.
func ReplayGroup(cfg Config) string { return cfg.withDefaults().Group + ".dlq-replay" }

// replayChunk is how many dead letters a replay re-publishes (and records
// as replayed) at a time.
const replayChunk = 500

// ReplayResult says what [ReplayDeadLetters] re-published.
type ReplayResult struct {
	Republished int
	ByTopic     map[string]int
	// Refused are the dead letters not sent because they name a topic
	// other than the one the indexer consumes, one per partition (the
	// partition's replay stops there).
	Refused []RefusedDeadLetter
}

// RefusedDeadLetter is a dead letter a replay did not send: its dlq_topic
// header names Topic, not the topic the indexer consumes.
type RefusedDeadLetter struct {
	Partition int
	Offset    int64
	Topic     string
}

// ReplayOptions are the choices of [ReplayDeadLettersWith].
type ReplayOptions struct {
	// To sends every dead letter to this topic, whatever its dlq_topic
	// header says. It must be the topic the indexer consumes (cfg.Topic).
	// Default "": each goes to the topic its header names, which must be
	// cfg.Topic.
	To string
}

// ReplayDeadLetters is [ReplayDeadLettersWith] without options.
func ReplayDeadLetters(ctx context.Context, cfg Config) (ReplayResult, error) {
	return ReplayDeadLettersWith(ctx, cfg, ReplayOptions{})
}

// ReplayDeadLettersWith re-publishes every dead-lettered message not
// replayed before to the topic it came from (header dlq_topic), with its
// original key, value and headers, and records its progress as committed
// offsets of [ReplayGroup]. It stops at the end offsets seen when it
// starts. Run it after fixing the cause (a mapping, the document); a
// message that fails again is dead-lettered again with fresh error headers.
//
// It writes only to the topic the indexer consumes (cfg.Topic): whoever
// can write the dead-letter topic must not choose where a replay writes. A
// dead letter naming another topic is not sent, nor is anything after it
// in its partition (the progress stops before it, so nothing is skipped);
// it is listed in ReplayResult.Refused and the error names it. opts.To
// sends everything to cfg.Topic regardless of the header, once an operator
// has looked.
func ReplayDeadLettersWith(ctx context.Context, cfg Config, opts ReplayOptions) (ReplayResult, error) {
	cfg = cfg.withDefaults()
	res := ReplayResult{ByTopic: map[string]int{}}
	if opts.To != "" && opts.To != cfg.Topic {
		return res, fmt.Errorf("--to=%s: dead letters are replayed only to the topic this indexer consumes, TOPIC=%s", opts.To, cfg.Topic)
	}
	c := &kafka.Client{Addr: kafka.TCP(cfg.Brokers...), Timeout: 30 * time.Second, Transport: cfg.kafkaTransport()}
	group := ReplayGroup(cfg)
	offs, err := topicOffsets(ctx, c, cfg.DeadLetterTopic, group)
	if err != nil {
		return res, err
	}
	w := &kafka.Writer{
		// The publisher's partitioner: a replayed key joins its other events.
		Addr: kafka.TCP(cfg.Brokers...), Balancer: kafkakey.Balancer(), RequiredAcks: kafka.RequireAll,
		BatchTimeout: 5 * time.Millisecond, MaxAttempts: 10,
		// A dead letter is as large as the dead-letter writer took it
		// (kafka-go's default is 1 MiB).
		BatchBytes: int64(cfg.DeadLetterMaxBytes),
		Transport:  c.Transport,
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
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: cfg.Brokers, Dialer: cfg.kafkaDialer("outboxrelay-indexer"), Topic: cfg.DeadLetterTopic, Partition: po.Partition, MaxWait: 250 * time.Millisecond})
		if err := r.SetOffset(from); err != nil {
			r.Close()
			return res, err
		}
		// Re-published and recorded a chunk at a time: the topic keeps
		// dead letters forever, each up to DeadLetterMaxBytes.
		var out []kafka.Message
		outBytes := 0
		last := from - 1
		flush := func() error {
			if len(out) == 0 {
				return nil
			}
			if err := w.WriteMessages(ctx, out...); err != nil {
				return fmt.Errorf("re-publish %d dead-lettered message(s): %w", len(out), err)
			}
			res.Republished += len(out)
			for _, m := range out {
				res.ByTopic[m.Topic]++
			}
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
				return fmt.Errorf("record replay progress of %s/%d: %w", cfg.DeadLetterTopic, po.Partition, err)
			}
			cfg.Logger.Info("dead letters re-published", slog.Int("partition", po.Partition), slog.Int("messages", len(out)))
			out, outBytes = out[:0], 0
			return nil
		}
		for last < po.End-1 {
			m, err := r.FetchMessage(ctx)
			if err != nil {
				r.Close()
				return res, fmt.Errorf("read %s/%d: %w", cfg.DeadLetterTopic, po.Partition, err)
			}
			topic, _ := header(m, HeaderDLQTopic)
			if topic == "" || opts.To != "" {
				topic = cfg.Topic
			}
			if topic != cfg.Topic {
				res.Refused = append(res.Refused, RefusedDeadLetter{Partition: po.Partition, Offset: m.Offset, Topic: topic})
				cfg.Logger.Warn("dead letter names a topic this indexer does not consume: not re-published, nor what follows it in its partition",
					slog.String("topic", cfg.DeadLetterTopic), slog.Int("partition", po.Partition), slog.Int64("offset", m.Offset), slog.String("dlq_topic", topic))
				break
			}
			var h []kafka.Header
			for _, mh := range m.Headers {
				if !strings.HasPrefix(mh.Key, "dlq_") {
					h = append(h, mh)
				}
			}
			if len(out) > 0 && (len(out) >= replayChunk || outBytes+len(m.Value) > cfg.DeadLetterMaxBytes) {
				if err := flush(); err != nil {
					r.Close()
					return res, err
				}
			}
			last = m.Offset
			out = append(out, kafka.Message{Topic: topic, Key: m.Key, Value: m.Value, Headers: h})
			outBytes += len(m.Key) + len(m.Value)
		}
		r.Close()
		if err := flush(); err != nil {
			return res, err
		}
	}
	if len(res.Refused) > 0 {
		var where []string
		for _, rf := range res.Refused {
			where = append(where, fmt.Sprintf("%s/%d@%d names %q", cfg.DeadLetterTopic, rf.Partition, rf.Offset, rf.Topic))
		}
		return res, fmt.Errorf("dead letters naming a topic other than TOPIC=%s were not re-published (%s), nor what follows them in their partition: check them, then run again with --to %s to send them there",
			cfg.Topic, strings.Join(where, ", "), cfg.Topic)
	}
	return res, nil
}
