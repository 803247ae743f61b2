package outbox

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"time"

	"github.com/segmentio/kafka-go"
)

// storedEvent is one outbox_events row as the publisher reads it.
type storedEvent struct {
	id               int64
	eventID          string
	topic            string
	aggregateType    string
	aggregateID      string
	aggregateVersion int64
	eventType        string
	payload          []byte // nil for deletes
	headers          []byte // JSON object
	createdAt        time.Time
}

// record builds the Kafka record of an event: the contract in record.go.
func (e *storedEvent) record(source string) (kafka.Message, error) {
	var extra map[string]string
	if len(e.headers) > 0 {
		if err := json.Unmarshal(e.headers, &extra); err != nil {
			return kafka.Message{}, fmt.Errorf("event %s: headers are not a JSON object of strings: %w", e.eventID, err)
		}
	}
	hs := make([]kafka.Header, 0, 9+len(extra))
	add := func(k, v string) { hs = append(hs, kafka.Header{Key: k, Value: []byte(v)}) }
	add(HeaderSpecVersion, SpecVersion)
	add(HeaderID, e.eventID)
	add(HeaderSource, source)
	add(HeaderType, TypePrefix+e.eventType)
	add(HeaderSubject, e.aggregateID)
	add(HeaderTime, e.createdAt.UTC().Format(time.RFC3339Nano))
	add(HeaderAggregateVersion, strconv.FormatInt(e.aggregateVersion, 10))
	if e.aggregateType != "" {
		add(HeaderAggregateType, e.aggregateType)
	}
	if e.payload != nil {
		add(HeaderContentType, "application/json")
	}
	// Application headers (traceparent, ...) follow in a stable order; they
	// never replace the CloudEvents attributes above.
	keys := make([]string, 0, len(extra))
	for k := range extra {
		switch k {
		case HeaderSpecVersion, HeaderID, HeaderSource, HeaderType, HeaderSubject, HeaderTime,
			HeaderAggregateVersion, HeaderAggregateType, HeaderContentType:
			continue
		}
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		add(k, extra[k])
	}
	return kafka.Message{Topic: e.topic, Key: []byte(e.aggregateID), Value: e.payload, Headers: hs}, nil
}

// messageSize is kafka-go's own size estimate of a message (the unexported
// Message.totalSize), the number it compares with Writer.BatchBytes. The
// publisher keeps every WriteMessages call under BatchBytes with it, so
// kafka-go never splits one call's messages for a partition into two produce
// requests (see doc.go, "One request per partition").
func messageSize(m *kafka.Message) int {
	n := varIntLen(len(m.Headers))
	for _, h := range m.Headers {
		n += varIntLen(len(h.Key)) + len(h.Key) + varIntLen(len(h.Value)) + len(h.Value)
	}
	return n + 4 + 1 + 1 + 4 + len(m.Key) + 4 + len(m.Value) + 8
}

func varIntLen(n int) int {
	var buf [binary.MaxVarintLen64]byte
	return binary.PutVarint(buf[:], int64(n))
}

// ErrMessageTooLarge is the error recorded for an event larger than
// Config.BatchBytes: the broker would refuse it (message.max.bytes), so it
// goes to the dead-letter table without a round trip.
var ErrMessageTooLarge = errors.New("message larger than the batch byte limit")

// permanentCodes are the broker answers that will not change on a retry of
// the same record: the record goes to the dead-letter table.
var permanentCodes = []kafka.Error{
	kafka.MessageSizeTooLarge,
	kafka.RecordListTooLarge,
	kafka.InvalidRecord,
	kafka.InvalidTopic,
	kafka.InvalidTimestamp,
	kafka.UnsupportedForMessageFormat,
}

// IsPermanent reports whether a produce error concerns the record itself and
// will not heal on a retry. Anything else (broker down, leader moving,
// timeouts, authorization being fixed) is retried with backoff, because
// dead-lettering a healthy event would break its key's order for nothing.
func IsPermanent(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, ErrMessageTooLarge) {
		return true
	}
	var tooLarge kafka.MessageTooLargeError
	if errors.As(err, &tooLarge) {
		return true
	}
	for _, code := range permanentCodes {
		if errors.Is(err, code) {
			return true
		}
	}
	return false
}

// errorCode extracts the Kafka error code of err, 0 if it has none.
func errorCode(err error) int32 {
	var kerr kafka.Error
	if errors.As(err, &kerr) {
		return int32(kerr)
	}
	return 0
}
