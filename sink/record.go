package sink

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"

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
	body    []byte // document or tombstone
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
	// The last value wins, as in most Kafka clients' lastHeader.
	var v string
	var ok bool
	for _, h := range m.Headers {
		if h.Key == key {
			v, ok = string(h.Value), true
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
	v, ok := header(m, outbox.HeaderAggregateVersion)
	if !ok {
		return poison(CodeBadVersion, "header %s is missing", outbox.HeaderAggregateVersion)
	}
	ver, err := strconv.ParseInt(v, 10, 64)
	if err != nil || ver < 0 {
		return poison(CodeBadVersion, "header %s=%q is not a non-negative decimal", outbox.HeaderAggregateVersion, v)
	}
	d.version = ver
	typ, _ := header(m, outbox.HeaderType)
	switch typ {
	case outbox.TypePrefix + "upsert":
		d.op = opUpsert
		if m.Value == nil {
			return poison(CodeMissingDocument, "upsert without a document")
		}
		if len(m.Value) > maxDocBytes {
			return poison(CodeDocumentTooLarge, "document of %d bytes exceeds the limit of %d", len(m.Value), maxDocBytes)
		}
		trimmed := bytes.TrimSpace(m.Value)
		if len(trimmed) == 0 || trimmed[0] != '{' || !json.Valid(trimmed) {
			return poison(CodeInvalidJSON, "document is not a JSON object")
		}
		if bytes.ContainsAny(trimmed, "\r\n") {
			// A bulk body is newline-delimited: a pretty-printed document
			// would split into several lines.
			var buf bytes.Buffer
			if err := json.Compact(&buf, trimmed); err != nil {
				return poison(CodeInvalidJSON, "document is not a JSON object")
			}
			trimmed = buf.Bytes()
		}
		d.body = withReconcileFields(trimmed, d.id, d.version, false)
	case outbox.TypePrefix + "delete":
		d.op = opDelete
		d.body = withReconcileFields(tombstoneDoc, d.id, d.version, true)
	default:
		return poison(CodeUnknownType, "header %s=%q: want %supsert or %sdelete", outbox.HeaderType, typ, outbox.TypePrefix, outbox.TypePrefix)
	}
	return d
}

// withReconcileFields appends the fields package reconcile aggregates on
// (the id's bucket and a hash of id, version and deleted-ness) to a JSON
// object, so reconciliation compares summaries instead of scanning
// documents. _bucket and _idv are reserved names in indexed documents.
func withReconcileFields(obj []byte, id string, version int64, deleted bool) []byte {
	out := make([]byte, 0, len(obj)+48)
	out = append(out, obj[:len(obj)-1]...) // without the closing brace
	if len(bytes.TrimSpace(out[1:])) > 0 {
		out = append(out, ',')
	}
	out = append(out, `"`+reconcile.FieldBucket+`":`...)
	out = strconv.AppendInt(out, int64(reconcile.Bucket(id)), 10)
	out = append(out, `,"`+reconcile.FieldIDV+`":`...)
	out = strconv.AppendInt(out, reconcile.IDV(id, version, deleted), 10)
	return append(out, '}')
}
