package outbox

import (
	"encoding/hex"
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
// types) are made into strings once.
func scanEvents(rows pgx.Rows, limit int) (*batch, error) {
	defer rows.Close()
	var b *batch
	var out []storedEvent
	var topic, aggregateType, eventType string
	// The fixed-size columns are scanned through one argument list for the
	// whole batch (a list per row would be an allocation per row); the rest
	// are read raw. Columns: id, event_id, topic, aggregate_type,
	// aggregate_id, aggregate_version, event_type, payload, headers,
	// created_at (readSQL).
	var id, version int64
	var createdAt time.Time
	dest := []any{&id, nil, nil, nil, nil, &version, nil, nil, nil, &createdAt}
	for rows.Next() {
		if b == nil {
			b = batchPool.Get().(*batch)
			out = slices.Grow(b.events[:0], limit)
		}
		if err := rows.Scan(dest...); err != nil {
			return nil, err
		}
		out = append(out, storedEvent{id: id, aggregateVersion: version, createdAt: createdAt})
		e := &out[len(out)-1]
		raw, fields := rows.RawValues(), rows.FieldDescriptions()
		buf := &b.rows
		e.eventID = eventIDText(buf, raw[1], &fields[1])
		topic, aggregateType, eventType = same(topic, raw[2]), same(aggregateType, raw[3]), same(eventType, raw[6])
		e.topic, e.aggregateType, e.eventType = topic, aggregateType, eventType
		e.aggregateID = buf.copy(raw[4])
		e.payload = buf.copy(jsonText(raw[7], &fields[7]))
		e.headers = buf.copy(jsonText(raw[8], &fields[8]))
	}
	if b != nil {
		b.events = out
	}
	return b, rows.Err()
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
