package outbox

import (
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/segmentio/kafka-go"
)

// batch is one read of a shard: its events, the memory their columns were
// copied into, and what their records are built with. Batches come from
// batchPool and go back to it once published and recorded, so a busy shard
// reuses the same few megabytes instead of allocating them batch after
// batch (and the garbage collector has that much less to do).
type batch struct {
	events []storedEvent
	rows   arena // the events' variable-length columns
	rb     recordBuilder
	all    []pendingEvent
	msgs   []kafka.Message // the records of a produce call
}

var batchPool = sync.Pool{New: func() any { return new(batch) }}

func (b *batch) len() int {
	if b == nil {
		return 0
	}
	return len(b.events)
}

// release gives b back for reuse. Nothing may use b or anything built from
// it afterwards: the next batch overwrites its rows' bytes and its records.
// So only a batch that kafka-go is certainly done with may be released; any
// other is left to the garbage collector (see publishBatch).
func (b *batch) release() {
	clear(b.events)
	b.events = b.events[:0]
	b.rows.reset()
	clear(b.all)
	b.all = b.all[:0]
	clear(b.rb.slab)
	clear(b.msgs)
	b.msgs = b.msgs[:0]
	batchPool.Put(b)
}

// scanEvents reads a batch of events with a handful of allocations: the
// variable-length columns are copied from pgx's row buffer into shared
// chunks (arena), and the columns that repeat from row to row (topic,
// types) are made into strings once. An event group's row (migration 019)
// becomes its members, in order: each member's payload is its element of
// the group's JSON array, in the one copy of the array.
func scanEvents(rows pgx.Rows, limit int) (*batch, error) {
	defer rows.Close()
	var b *batch
	var out []storedEvent
	var topic, aggregateType, eventType string
	// The fixed-size columns and the group's arrays are scanned through
	// one argument list for the whole batch (a list per row would be an
	// allocation per row); the rest are read raw. Columns: id, event_id,
	// topic, aggregate_type, aggregate_id, aggregate_version, event_type,
	// payload, headers, created_at, group_ids, group_versions,
	// group_event_ids, group_types (readSQL).
	var id, version int64
	var createdAt time.Time
	var g group
	dest := []any{&id, nil, nil, nil, nil, &version, nil, nil, nil, &createdAt, &g.ids, &g.versions, &g.eventIDs, &g.types}
	for rows.Next() {
		if b == nil {
			b = batchPool.Get().(*batch)
			out = slices.Grow(b.events[:0], limit)
		}
		if err := rows.Scan(dest...); err != nil {
			return nil, err
		}
		raw, fields := rows.RawValues(), rows.FieldDescriptions()
		buf := &b.rows
		topic, aggregateType = same(topic, raw[2]), same(aggregateType, raw[3])
		payload, headers := buf.copy(jsonText(raw[7], &fields[7])), buf.copy(jsonText(raw[8], &fields[8]))
		if g.ids != nil {
			var err error
			if out, err = g.expand(out, buf, id, topic, aggregateType, payload, headers, createdAt); err != nil {
				return nil, err
			}
			continue
		}
		out = append(out, storedEvent{id: id, aggregateVersion: version, createdAt: createdAt})
		e := &out[len(out)-1]
		e.eventID = eventIDText(buf, raw[1], &fields[1])
		eventType = same(eventType, raw[6])
		e.topic, e.aggregateType, e.eventType = topic, aggregateType, eventType
		e.aggregateID = buf.copy(raw[4])
		e.payload, e.headers = payload, headers
	}
	if b != nil {
		b.events = out
	}
	return b, rows.Err()
}

// group is an event group's member arrays as scanned.
type group struct {
	ids, types []string
	versions   []int64
	eventIDs   [][16]byte
}

// expand appends the members of the group in row id to out. payload is the
// group's JSON array; each member's payload is its element (nil for a
// delete, as a single delete's NULL payload).
func (g *group) expand(out []storedEvent, buf *arena, id int64, topic, aggregateType string, payload, headers []byte, createdAt time.Time) ([]storedEvent, error) {
	n := len(g.ids)
	elems, err := splitJSONArray(payload, n)
	if err != nil {
		return out, fmt.Errorf("event group %d: payload: %w", id, err)
	}
	if len(g.versions) != n || len(g.eventIDs) != n || len(g.types) != n {
		return out, fmt.Errorf("event group %d: %d ids, %d versions, %d event ids, %d types", id, n, len(g.versions), len(g.eventIDs), len(g.types))
	}
	for i := range n {
		e := storedEvent{id: id, member: int32(i + 1), aggregateVersion: g.versions[i], createdAt: createdAt,
			topic: topic, aggregateType: aggregateType, eventType: g.types[i], headers: headers}
		e.eventID = buf.appendFunc(func(dst []byte) []byte { return appendUUID(dst, g.eventIDs[i][:]) })
		e.aggregateID = buf.appendFunc(func(dst []byte) []byte { return append(dst, g.ids[i]...) })
		if p := elems[i]; e.eventType != "delete" && string(p) != "null" {
			e.payload = p
		}
		out = append(out, e)
	}
	return out, nil
}

// splitJSONArray returns the n elements of the JSON array text a, as
// subslices of a without surrounding whitespace. PostgreSQL checked the
// text (a json value, an array of n elements: migration 019's CHECK), so
// this only finds the boundaries: commas and the closing bracket outside
// strings, objects and arrays.
func splitJSONArray(a []byte, n int) ([][]byte, error) {
	i := skipSpace(a, 0)
	if i == len(a) || a[i] != '[' {
		return nil, errors.New("not a JSON array")
	}
	out := make([][]byte, 0, n)
	i = skipSpace(a, i+1)
	if i < len(a) && a[i] == ']' {
		i++
	} else {
		start, depth := i, 0
	scan:
		for ; ; i++ {
			if i >= len(a) {
				return nil, errors.New("unterminated JSON array")
			}
			switch a[i] {
			case '"':
				for i++; i < len(a) && a[i] != '"'; i++ {
					if a[i] == '\\' {
						i++
					}
				}
			case '{', '[':
				depth++
			case '}':
				depth--
			case ']':
				if depth == 0 {
					out = append(out, trimSpaceRight(a[start:i]))
					i++
					break scan
				}
				depth--
			case ',':
				if depth == 0 {
					out = append(out, trimSpaceRight(a[start:i]))
					start = skipSpace(a, i+1)
					i = start - 1
				}
			}
		}
	}
	if skipSpace(a, i) != len(a) {
		return nil, errors.New("text after the JSON array")
	}
	if len(out) != n {
		return nil, fmt.Errorf("%d elements for %d members", len(out), n)
	}
	return out, nil
}

func trimSpaceRight(a []byte) []byte {
	for len(a) > 0 && skipSpace(a[len(a)-1:], 0) == 1 {
		a = a[:len(a)-1]
	}
	return a
}

// same returns v as a string: prev itself when equal, without allocating.
func same(prev string, v []byte) string {
	if prev == string(v) {
		return prev
	}
	return string(v)
}

// eventIDText is the event_id column's value in its text form, in a: the
// read asks for the uuid itself (binary, 16 bytes) and formats it here,
// which spares PostgreSQL printing it; a connection that reads text (the
// simple protocol) gets the text as it came.
func eventIDText(a *arena, v []byte, f *pgconn.FieldDescription) []byte {
	if f.Format != pgx.BinaryFormatCode || len(v) != 16 {
		return a.copy(v)
	}
	return a.appendFunc(func(dst []byte) []byte {
		return appendUUID(dst, v)
	})
}

// appendUUID appends the 16 bytes of u in the canonical text form,
// 8-4-4-4-12 lowercase hex digits (what PostgreSQL prints).
func appendUUID(dst, u []byte) []byte {
	dst = hex.AppendEncode(dst, u[0:4])
	for _, part := range [...][]byte{u[4:6], u[6:8], u[8:10], u[10:16]} {
		dst = append(dst, '-')
		dst = hex.AppendEncode(dst, part)
	}
	return dst
}

// jsonText is a json or jsonb column's value as JSON text: jsonb's binary
// format starts with a version byte (pgx asks for text, where json and
// jsonb are alike, but a connection may be set up otherwise).
func jsonText(v []byte, f *pgconn.FieldDescription) []byte {
	if f.DataTypeOID == pgtype.JSONBOID && f.Format == pgx.BinaryFormatCode && len(v) > 0 {
		return v[1:]
	}
	return v
}
