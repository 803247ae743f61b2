package outbox

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/segmentio/kafka-go"
)

// storedEvent is one outbox_events row as the publisher reads it. The byte
// fields share the batch's buffers (see scanEvents): they are not written
// until the batch is released for reuse (batch.release).
type storedEvent struct {
	id               int64
	member           int32  // 1.. in an event group (migration 019), 0 for a row of its own
	eventID          []byte // text form
	topic            string
	aggregateType    string
	aggregateID      []byte
	aggregateVersion int64
	eventType        string
	payload          []byte // nil for deletes
	headers          []byte // JSON object
	createdAt        time.Time
}

// Header values that are the same for every record. kafka-go only reads
// header values, so all records share these.
var (
	specVersionValue = []byte(SpecVersion)
	contentTypeValue = []byte("application/json")
)

// recordBuilder builds the Kafka records of one batch (the contract in
// record.go). Header values and header slices come from batch-wide buffers,
// and the key, subject and id are the row's own bytes, so a record costs a
// few appends instead of a dozen small allocations.
type recordBuilder struct {
	source []byte
	types  map[string][]byte // event type → ce_type value
	aggs   map[string][]byte // aggregate type → its bytes
	values arena
	slab   []kafka.Header
	extra  []kafka.Header    // the event's own headers, reused per record
	keys   map[string]string // their keys, made once
}

func newRecordBuilder(source string, events int) *recordBuilder {
	rb := &recordBuilder{}
	rb.reset(source, events)
	return rb
}

// reset readies rb for a batch of events, reusing its buffers: the records
// it built before must no longer be in use.
func (rb *recordBuilder) reset(source string, events int) {
	if string(rb.source) != source {
		rb.source = []byte(source)
	}
	if rb.types == nil {
		rb.types, rb.aggs, rb.keys = map[string][]byte{}, map[string][]byte{}, map[string]string{}
	}
	clear(rb.types)
	clear(rb.aggs)
	clear(rb.keys)
	rb.values.reset()
	if cap(rb.slab) < events*(standardHeaders+slabExtra) {
		rb.slab = make([]kafka.Header, 0, events*(standardHeaders+slabExtra))
	}
	rb.slab = rb.slab[:0]
}

// standardHeaders is how many headers every record carries at most before
// the event's own (ce_* and content-type).
const standardHeaders = 9

// slabExtra is how many of an event's own headers the slab has room for
// per event: the batcher's ce_processorversion and traceparent.
const slabExtra = 2

// emptyHeaders is how an event without headers stores them (the column
// default), recognised without a JSON parse.
var emptyHeaders = []byte("{}")

// record builds the Kafka record of e.
func (rb *recordBuilder) record(e *storedEvent) (kafka.Message, error) {
	extra, err := e.extraHeaders(rb.extra[:0], rb.keys)
	if err != nil {
		return kafka.Message{}, err
	}
	rb.extra = extra[:0]
	var hs []kafka.Header
	if want := standardHeaders + len(extra); cap(rb.slab)-len(rb.slab) >= want {
		n := len(rb.slab)
		hs = rb.slab[n : n : n+want]
		rb.slab = rb.slab[:n+want]
	} else {
		hs = make([]kafka.Header, 0, want)
	}
	hs = append(hs,
		kafka.Header{Key: HeaderSpecVersion, Value: specVersionValue},
		kafka.Header{Key: HeaderID, Value: e.eventID},
		kafka.Header{Key: HeaderSource, Value: rb.source},
		kafka.Header{Key: HeaderType, Value: intern(rb.types, TypePrefix, e.eventType)},
		kafka.Header{Key: HeaderSubject, Value: e.aggregateID},
		kafka.Header{Key: HeaderTime, Value: rb.values.appendFunc(func(b []byte) []byte {
			return e.createdAt.UTC().AppendFormat(b, time.RFC3339Nano)
		})},
		kafka.Header{Key: HeaderAggregateVersion, Value: rb.values.appendFunc(func(b []byte) []byte {
			return strconv.AppendInt(b, e.aggregateVersion, 10)
		})},
	)
	if e.aggregateType != "" {
		hs = append(hs, kafka.Header{Key: HeaderAggregateType, Value: intern(rb.aggs, "", e.aggregateType)})
	}
	if e.payload != nil {
		hs = append(hs, kafka.Header{Key: HeaderContentType, Value: contentTypeValue})
	}
	// Application headers (ce_processorversion, traceparent, ...) follow,
	// sorted by key; they never replace the CloudEvents attributes above.
	std := len(hs)
	for _, h := range extra {
		switch h.Key {
		case HeaderSpecVersion, HeaderID, HeaderSource, HeaderType, HeaderSubject, HeaderTime,
			HeaderAggregateVersion, HeaderAggregateType, HeaderContentType:
			continue
		}
		hs = append(hs, h)
		for i := len(hs) - 1; i > std && hs[i].Key < hs[i-1].Key; i-- { // a few keys: insertion sort
			hs[i], hs[i-1] = hs[i-1], hs[i]
		}
	}
	return kafka.Message{Topic: e.topic, Key: e.aggregateID, Value: e.payload, Headers: hs}, nil
}

// extraHeaders appends the event's own headers to dst: none for the column
// default "{}"; the batcher's (a flat object of plain strings, as jsonb
// prints it) without a JSON parse and without allocating, the values
// sliced from e.headers; anything else through encoding/json.
func (e *storedEvent) extraHeaders(dst []kafka.Header, keys map[string]string) ([]kafka.Header, error) {
	if len(e.headers) == 0 || bytes.Equal(e.headers, emptyHeaders) {
		return dst, nil
	}
	if out, ok := flatHeaders(e.headers, dst, keys); ok {
		return out, nil
	}
	var extra map[string]string
	if err := json.Unmarshal(e.headers, &extra); err != nil {
		return dst, fmt.Errorf("event %s: headers are not a JSON object of strings: %w", e.eventID, err)
	}
	for k, v := range extra {
		dst = append(dst, kafka.Header{Key: k, Value: []byte(v)})
	}
	return dst, nil
}

// flatHeaders parses b when it is a JSON object whose keys and values are
// strings without escapes, appending one header per member to dst (keys
// interned in keys, values sliced from b); ok is false for anything else,
// and for a repeated key, which encoding/json then resolves.
func flatHeaders(b []byte, dst []kafka.Header, keys map[string]string) (out []kafka.Header, ok bool) {
	n := len(dst)
	i := skipSpace(b, 0)
	if i >= len(b) || b[i] != '{' {
		return dst, false
	}
	i = skipSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		return dst, skipSpace(b, i+1) == len(b)
	}
	for {
		key, j, ok := plainString(b, i)
		if !ok {
			return dst[:n], false
		}
		j = skipSpace(b, j)
		if j >= len(b) || b[j] != ':' {
			return dst[:n], false
		}
		val, k, ok := plainString(b, skipSpace(b, j+1))
		if !ok {
			return dst[:n], false
		}
		for _, h := range dst[n:] {
			if h.Key == string(key) {
				return dst[:n], false
			}
		}
		name, seen := keys[string(key)]
		if !seen {
			name = string(key)
			keys[name] = name
		}
		dst = append(dst, kafka.Header{Key: name, Value: val[:len(val):len(val)]})
		i = skipSpace(b, k)
		switch {
		case i < len(b) && b[i] == ',':
			i = skipSpace(b, i+1)
		case i < len(b) && b[i] == '}':
			return dst, skipSpace(b, i+1) == len(b)
		default:
			return dst[:n], false
		}
	}
}

// plainString reads the JSON string at b[i:] when it has no escape and no
// control character: its contents and the index after its closing quote.
func plainString(b []byte, i int) (s []byte, next int, ok bool) {
	if i >= len(b) || b[i] != '"' {
		return nil, i, false
	}
	for j := i + 1; j < len(b); j++ {
		switch c := b[j]; {
		case c == '"':
			return b[i+1 : j], j + 1, true
		case c == '\\' || c < 0x20:
			return nil, i, false
		}
	}
	return nil, i, false
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// intern returns prefix+s as bytes, made once per batch.
func intern(m map[string][]byte, prefix, s string) []byte {
	b, ok := m[s]
	if !ok {
		b = []byte(prefix + s)
		m[s] = b
	}
	return b
}

// arena hands out byte slices carved from shared 64 KiB chunks: one
// allocation per chunk instead of one per value. A slice it returned is
// not written again (its capacity ends at its length) until reset, which
// hands the same chunks out again.
type arena struct {
	chunk  []byte   // the chunk values are carved from
	chunks [][]byte // every 64 KiB chunk allocated, for reuse after reset
	used   int      // chunks[:used] have been handed out since reset
}

const arenaChunk = 64 << 10

// copy returns a copy of b in the arena (nil for nil).
func (a *arena) copy(b []byte) []byte {
	if b == nil {
		return nil
	}
	a.reserve(len(b))
	return a.take(append(a.chunk, b...))
}

// appendFunc returns what fn appends to an empty slice, in the arena. fn
// must append at most 64 bytes.
func (a *arena) appendFunc(fn func([]byte) []byte) []byte {
	a.reserve(64)
	return a.take(fn(a.chunk))
}

func (a *arena) reserve(n int) {
	switch {
	case cap(a.chunk)-len(a.chunk) >= n:
	case n > arenaChunk: // a value of its own, not kept for reuse
		a.chunk = make([]byte, 0, n)
	case a.used < len(a.chunks):
		a.chunk = a.chunks[a.used][:0]
		a.used++
	default:
		a.chunk = make([]byte, 0, arenaChunk)
		a.chunks = append(a.chunks, a.chunk)
		a.used = len(a.chunks)
	}
}

// reset makes the arena hand out its chunks again from the start: every
// slice it returned before will be overwritten, so none may be in use.
func (a *arena) reset() {
	a.chunk, a.used = nil, 0
}

// take returns grown[len(a.chunk):] and moves the chunk past it. grown is
// a.chunk with bytes appended in place (reserve made the room).
func (a *arena) take(grown []byte) []byte {
	n := len(a.chunk)
	a.chunk = grown
	return grown[n:len(grown):len(grown)]
}

// messageSize is kafka-go's own size estimate of a message (the unexported
// Message.totalSize). The publisher keeps every produce call under
// BatchBytes with it, so one partition's share of a call stays under the
// broker's message.max.bytes (see doc.go, "One request per partition").
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

// topicUnavailable reports whether err says the topic does not exist or the
// publisher may not write to it. Both can heal (a topic being created, an
// ACL being granted, metadata catching up, a topic list being extended), so an event waits TopicWait
// for its topic before it is dead-lettered.
func topicUnavailable(err error) bool {
	return errors.Is(err, kafka.UnknownTopicOrPartition) || errors.Is(err, kafka.TopicAuthorizationFailed) || errors.Is(err, ErrTopicNotListed)
}

// ErrTopicNotListed is the error of an event whose topic is not in
// Config.Topics when that list is set. It waits TopicWait like a missing
// topic (the list may be on its way), then it is dead-lettered.
var ErrTopicNotListed = errors.New("the topic is not in PUBLISHER_TOPICS (add it there, create it with `publisher topics ensure`, restart the publishers)")

// errorCode extracts the Kafka error code of err, 0 if it has none.
func errorCode(err error) int32 {
	var kerr kafka.Error
	if errors.As(err, &kerr) {
		return int32(kerr)
	}
	return 0
}
