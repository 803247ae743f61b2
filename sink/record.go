package sink

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/outboxrelay/outboxrelay/outbox"
	"github.com/outboxrelay/outboxrelay/reconcile"
)

// DeletedField marks a delete tombstone document. The read alias filters
// documents with DeletedField = true out of searches.
const DeletedField = "_deleted"

// tombstoneDoc is the body written for a delete: a real document, so the
// engine keeps its external version forever (see doc.go).
var tombstoneDoc = []byte(`{"` + DeletedField + `":true}`)

// Error codes written in the dead-letter header ErrorHeaderCode for
// messages that never reached the engine.
const (
	CodeMissingKey       = "missing_key"
	CodeBadVersion       = "bad_version"
	CodeUnknownType      = "unknown_type"
	CodeMissingDocument  = "missing_document"
	CodeInvalidJSON      = "invalid_json"
	CodeDocumentTooLarge = "document_too_large"
)

type op int

const (
	opUpsert op = iota
	opDelete
)

// doc is one Kafka message on its way into a bulk request.
type doc struct {
	msg     kafka.Message
	id      string
	version int64
	op      op
	body    []byte // document or tombstone, without the reconcile fields
	// bucket and idv are the reconcile fields, computed by the fetch loop,
	// which runs ahead of the lanes, rather than while a lane builds its bulk.
	bucket  int
	idv     int64
	aggType []byte      // header ce_aggregatetype, written as reconcile.FieldAggregateType
	fetched time.Time   // when it entered the backlog
	gen     *generation // the group generation that fetched it: its offset is committed under it
	// poison is set when the message cannot be indexed at all; code and
	// reason then go into the dead-letter headers.
	poison *itemError
}

// itemError is why a document was dead-lettered.
type itemError struct {
	Code   string // an engine error type or one of the Code* constants
	Reason string
	Status int // HTTP status of the item, 0 if never sent
}

func header(m kafka.Message, key string) (string, bool) {
	v, ok := headerBytes(m, key)
	return string(v), ok
}

// headerBytes is header without the copy: every message is looked at.
func headerBytes(m kafka.Message, key string) ([]byte, bool) {
	// The last value wins, as in most Kafka clients' lastHeader.
	var v []byte
	var ok bool
	for _, h := range m.Headers {
		if h.Key == key {
			v, ok = h.Value, true
		}
	}
	return v, ok
}

// parse turns a message into a doc. It never fails: a message that cannot
// be indexed comes back with poison set.
func parse(m kafka.Message, maxDocBytes int) *doc {
	d := &doc{msg: m, id: string(m.Key)}
	poison := func(code, format string, args ...any) *doc {
		d.poison = &itemError{Code: code, Reason: fmt.Sprintf(format, args...)}
		return d
	}
	if d.id == "" {
		return poison(CodeMissingKey, "message has no key (the aggregate id)")
	}
	v, ok := headerBytes(m, outbox.HeaderAggregateVersion)
	if !ok {
		return poison(CodeBadVersion, "header %s is missing", outbox.HeaderAggregateVersion)
	}
	ver, err := strconv.ParseInt(string(v), 10, 64)
	if err != nil || ver < 0 {
		return poison(CodeBadVersion, "header %s=%q is not a non-negative decimal", outbox.HeaderAggregateVersion, v)
	}
	d.version = ver
	typ, _ := headerBytes(m, outbox.HeaderType)
	switch string(typ) {
	case outbox.TypePrefix + "upsert":
		d.op = opUpsert
		if m.Value == nil {
			return poison(CodeMissingDocument, "upsert without a document")
		}
		if len(m.Value) > maxDocBytes {
			return poison(CodeDocumentTooLarge, "document of %d bytes exceeds the limit of %d", len(m.Value), maxDocBytes)
		}
		trimmed := bytes.TrimSpace(m.Value)
		if len(trimmed) == 0 || trimmed[0] != '{' || !validJSON(trimmed) {
			return poison(CodeInvalidJSON, "document is not a JSON object")
		}
		if bytes.IndexByte(trimmed, '\n') >= 0 || bytes.IndexByte(trimmed, '\r') >= 0 {
			// A bulk body is newline-delimited: a pretty-printed document
			// would split into several lines.
			var buf bytes.Buffer
			if err := json.Compact(&buf, trimmed); err != nil {
				return poison(CodeInvalidJSON, "document is not a JSON object")
			}
			trimmed = buf.Bytes()
		}
		d.body = trimmed
	case outbox.TypePrefix + "delete":
		d.op = opDelete
		d.body = tombstoneDoc
	default:
		return poison(CodeUnknownType, "header %s=%q: want %supsert or %sdelete", outbox.HeaderType, typ, outbox.TypePrefix, outbox.TypePrefix)
	}
	d.aggType, _ = headerBytes(m, outbox.HeaderAggregateType)
	d.bucket = reconcile.Bucket(d.id)
	d.idv = reconcile.IDV(d.id, d.version, d.op == opDelete)
	return d
}

// appendDocument appends the document as indexed: the body plus the fields
// package reconcile aggregates on (the id's bucket and a hash of id,
// version and deleted-ness), so reconciliation compares summaries instead
// of scanning documents. _bucket and _idv are reserved names in indexed
// documents. They are added while the bulk body is written, which saves
// copying every document once more.
func appendDocument(dst []byte, d *doc) []byte {
	dst = appendReconcileFields(dst, d.body, d.bucket, d.idv)
	if len(d.aggType) == 0 {
		return dst
	}
	// The aggregate type says whose document it is when several producers
	// write into one index: reconcile compares (and repairs) only its own.
	dst = append(dst[:len(dst)-1], `,"`+reconcile.FieldAggregateType+`":`...)
	dst = appendJSONBytes(dst, d.aggType)
	return append(dst, '}')
}

func appendJSONBytes(dst, s []byte) []byte {
	for _, c := range s {
		if c < 0x20 || c >= 0x7f || c == '"' || c == '\\' {
			b, _ := json.Marshal(string(s)) // a Go string always marshals
			return append(dst, b...)
		}
	}
	dst = append(dst, '"')
	dst = append(dst, s...)
	return append(dst, '"')
}

// appendReconcileFields appends obj, a JSON object, with the reconcile
// fields added.
func appendReconcileFields(dst, obj []byte, bucket int, idv int64) []byte {
	start := len(dst)
	dst = append(dst, obj[:len(obj)-1]...) // without the closing brace
	if len(bytes.TrimSpace(dst[start+1:])) > 0 {
		dst = append(dst, ',')
	}
	dst = append(dst, `"`+reconcile.FieldBucket+`":`...)
	dst = strconv.AppendInt(dst, int64(bucket), 10)
	dst = append(dst, `,"`+reconcile.FieldIDV+`":`...)
	dst = strconv.AppendInt(dst, idv, 10)
	return append(dst, '}')
}
