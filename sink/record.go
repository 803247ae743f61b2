package sink

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxrelay/outboxrelay/internal/jsonvalid"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// Error codes written in the dead-letter header ErrorHeaderCode for
// messages that never reached the engine.
const (
	CodeMissingKey       = "missing_key"
	CodeBadVersion       = "bad_version"
	CodeUnknownType      = "unknown_type"
	CodeMissingDocument  = "missing_document"
	CodeInvalidJSON      = "invalid_json"
	CodeDocumentTooLarge = "document_too_large"
	CodeIDTooLong        = "id_too_long" // the _id would exceed MaxIDBytes
	CodeInvalidKey       = "invalid_key" // the key (the _id) is not UTF-8
	CodeNullValue        = "null_value"  // a null value that is not a delete event, with NullValues "fail"
	// CodeMissingAggregateType: IDFormat "type:id" and no ce_aggregatetype.
	CodeMissingAggregateType = "missing_aggregate_type"
	CodeReservedField        = "reserved_field" // the document has a top-level field the indexer or the engine owns
)

// MaxIDBytes is the engine's limit on an _id, in bytes of UTF-8: a longer
// one makes Elasticsearch and OpenSearch refuse the whole bulk request.
const MaxIDBytes = 512

// ReservedFields are top-level document fields an upsert may not carry:
// the indexer's own (a document with _deleted would be hidden as a
// tombstone; _bucket, _idv, _pv or, with NullValues "delete", _pos would be
// written twice) and the engine's metadata fields, which fail the item.
var ReservedFields = []string{
	FieldDeleted, FieldDeletedAt, FieldBucket, FieldIDV, FieldPV, FieldAggregateType, FieldPosition,
	"_id", "_index", "_routing", "_source", "_version", "_seq_no", "_primary_term", "_type",
	"_field_names", "_ignored", "_doc_count", "_data_stream_timestamp", "_nested_path", "_tier",
}

var reservedField = func() map[string]bool {
	m := map[string]bool{}
	for _, f := range ReservedFields {
		m[f] = true
	}
	return m
}()

// firstReserved returns the first of names (raw JSON string contents) that
// is a reserved field, or "". allowPosition: FieldPosition is the user's
// (the indexer writes it with NullValues "delete" only).
func firstReserved(names [][]byte, allowPosition bool) string {
	for _, raw := range names {
		name := string(raw)
		if bytes.IndexByte(raw, '\\') >= 0 {
			if err := json.Unmarshal([]byte(`"`+name+`"`), &name); err != nil {
				continue
			}
		}
		if reservedField[name] && !(allowPosition && name == FieldPosition) {
			return name
		}
	}
	return ""
}

type op int

const (
	opUpsert op = iota
	opDelete
)

// Why a message is skipped: counted, committed, never sent
// (indexer_skipped_total{reason}).
const (
	SkipAggregateType = "aggregate_type" // not in Config.AggregateTypes
	SkipEventType     = "event_type"     // in Config.SkipEventTypes
	SkipNullValue     = "null_value"     // Config.NullValues "ignore"
	SkipTxnMarker     = "txn_marker"     // another producer's transaction commit or abort marker
)

var (
	typeUpsert = outbox.TypePrefix + "upsert"
	typeDelete = outbox.TypePrefix + "delete"
)

// doc is one Kafka message on its way into a bulk request.
type doc struct {
	msg kafka.Message
	id  string
	// alias is the read alias the record is routed to (ROUTES); target is
	// the alias the document is written through: the alias's write alias,
	// or, for a document with a processor version, its generation's (set by
	// the router before each bulk request).
	alias, target string
	version       int64
	// versionFromIndex: a delete without a version (a null value from
	// another producer); version is filled in from the index and the
	// tombstone written with version_type=external_gte.
	versionFromIndex bool
	// overtaken: a versionFromIndex delete replayed after a later record
	// of its id was indexed; resolved as a conflict, never sent.
	overtaken bool
	// withPosition: FieldPosition is written (NullValues "delete").
	withPosition bool
	op           op
	body         []byte // document or tombstone, without the reconcile fields
	// deletedAt is FieldDeletedAt of a tombstone: when the delete was
	// parsed, in milliseconds since the epoch.
	deletedAt int64
	// bucket and idv are the reconcile fields, computed by the fetch loop,
	// which runs ahead of the lanes, rather than while a lane builds its bulk.
	bucket int
	idv    int64
	// pv is the processor version that built the document (header
	// ce_processorversion), "" when the event carries none. It picks the
	// index generation and is indexed as FieldPV.
	pv      string
	aggType []byte      // header ce_aggregatetype, written as FieldAggregateType
	fetched time.Time   // when it entered the backlog
	gen     *generation // the group generation that fetched it: its offset is committed under it
	// poison is set when the message cannot be indexed at all; code and
	// reason then go into the dead-letter headers.
	poison *itemError
	// skip is set (to a Skip* reason) when the deployment does not index
	// the message.
	skip string
	// span is the message's consumer span while the lane resolves it; nil
	// while tracing is off.
	span trace.Span
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
// be indexed comes back with poison set, one the deployment does not index
// with skip set.
func (r *recordRules) parse(m kafka.Message) *doc {
	d := &doc{msg: m, withPosition: r.nullValues == NullValuesDelete}
	poison := func(code, format string, args ...any) *doc {
		d.poison = &itemError{Code: code, Reason: fmt.Sprintf(format, args...)}
		return d
	}
	aggType, hasAggType := headerBytes(m, outbox.HeaderAggregateType)
	if r.aggregateTypes != nil && hasAggType && !r.aggregateTypes[string(aggType)] {
		d.skip = SkipAggregateType
		return d
	}
	typ, hasType := headerBytes(m, outbox.HeaderType)
	isUpsert, isDelete := string(typ) == typeUpsert, string(typ) == typeDelete
	// "*" skips another producer's records without ce_type too (a plain
	// Kafka producer sets no headers); their null values are NullValues'.
	if (hasType && !isUpsert && !isDelete && r.skipsEventType(typ)) || (!hasType && m.Value != nil && r.skipAllOthers) {
		d.skip = SkipEventType
		return d
	}
	// After the skips: another producer's records may have no key.
	if len(m.Key) == 0 {
		return poison(CodeMissingKey, "message has no key (the aggregate id)")
	}
	d.alias = r.targetAlias(m)
	d.target = r.writeAliasOf(d.alias)
	if r.typedIDs {
		if len(aggType) == 0 {
			return poison(CodeMissingAggregateType, "ID_FORMAT=type:id and header %s is missing", outbox.HeaderAggregateType)
		}
		d.id = string(aggType) + ":" + string(m.Key)
	} else {
		d.id = string(m.Key)
	}
	if !utf8.ValidString(d.id) {
		// JSON would replace each invalid byte with U+FFFD: two keys
		// would become one document.
		return poison(CodeInvalidKey, "the key is not UTF-8 (%q); the engine's _id is a string", d.id)
	}
	if len(d.id) > MaxIDBytes {
		return poison(CodeIDTooLong, "_id of %d bytes exceeds the engine's limit of %d", len(d.id), MaxIDBytes)
	}
	if m.Value == nil && (isUpsert || !hasType) { // a typed record of another kind is unknown_type below
		switch r.nullValues {
		case NullValuesIgnore:
			d.skip = SkipNullValue
			return d
		case NullValuesDelete:
			isUpsert, isDelete = false, true
		default:
			if !isUpsert {
				return poison(CodeNullValue, "null value (a Kafka tombstone) without %s; NULL_VALUES=fail", outbox.HeaderType)
			}
		}
	}
	v, ok := headerBytes(m, outbox.HeaderAggregateVersion)
	if !ok && isDelete && !hasType {
		// A null value from another producer: no version to write the
		// tombstone at. It takes the version the index holds for the id
		// when the batch is resolved (see versionsFromIndex).
		d.op, d.body, d.versionFromIndex = opDelete, tombstoneDoc, true
		d.deletedAt = time.Now().UnixMilli()
		d.bucket = Bucket(d.id)
		return d
	}
	if !ok {
		return poison(CodeBadVersion, "header %s is missing", outbox.HeaderAggregateVersion)
	}
	ver, err := strconv.ParseInt(string(v), 10, 64)
	if err != nil || ver < 0 {
		return poison(CodeBadVersion, "header %s=%q is not a non-negative decimal", outbox.HeaderAggregateVersion, v)
	}
	d.version = ver
	switch {
	case isUpsert:
		d.op = opUpsert
		if m.Value == nil {
			return poison(CodeMissingDocument, "upsert without a document")
		}
		if len(m.Value) > r.maxDocBytes {
			return poison(CodeDocumentTooLarge, "document of %d bytes exceeds the limit of %d", len(m.Value), r.maxDocBytes)
		}
		trimmed := bytes.TrimSpace(m.Value)
		if len(trimmed) == 0 || trimmed[0] != '{' {
			return poison(CodeInvalidJSON, "document is not a JSON object")
		}
		valid, underscored := jsonvalid.Document(trimmed)
		if !valid {
			return poison(CodeInvalidJSON, "document is not a JSON object")
		}
		if name := firstReserved(underscored, !d.withPosition); name != "" {
			return poison(CodeReservedField, "document has the reserved top-level field %q", name)
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
	case isDelete:
		d.op = opDelete
		d.body = tombstoneDoc
		d.deletedAt = time.Now().UnixMilli()
	default:
		return poison(CodeUnknownType, "header %s=%q: want %s or %s (SKIP_EVENT_TYPES skips others)", outbox.HeaderType, typ, typeUpsert, typeDelete)
	}
	if pv, ok := headerBytes(m, outbox.HeaderProcessorVersion); ok {
		d.pv = string(pv)
	}
	d.aggType = aggType
	d.bucket = Bucket(d.id)
	d.idv = IDV(d.id, d.version, d.op == opDelete, d.pv)
	return d
}
