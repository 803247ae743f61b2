package sink

import (
	"bytes"
	"crypto/md5"
	"encoding/binary"
	"encoding/json"
	"hash/fnv"
	"strconv"

	"github.com/outboxrelay/outboxrelay/index"
)

// The document format: what the indexer writes next to the user's
// document. Package reconcile reads these fields; it imports them from here.
const (
	// FieldDeleted marks a delete tombstone document. The read alias filters
	// documents with FieldDeleted = true out of searches.
	FieldDeleted = index.FieldDeleted
	// FieldBucket holds Bucket(id).
	FieldBucket = "_bucket"
	// FieldIDV holds IDV(id, version, deleted, processor version).
	FieldIDV = "_idv"
	// FieldPV holds the processor version that built the document (absent
	// for events that carry none).
	FieldPV = index.FieldPV
	// FieldAggregateType holds the event's ce_aggregatetype: whose document
	// it is when several producers write into one index, so reconcile
	// compares (and repairs) only its own source's documents.
	FieldAggregateType = index.FieldAggregateType
	// FieldPosition holds [partition, offset, topic tag] of the Kafka
	// record a document was written from, with NullValues "delete" only: a
	// null value without a version replayed after a later record of its key
	// was indexed must see that it is overtaken (see versionsFromIndex).
	// The topic tag ([topicTag]) tells positions of different topics apart;
	// documents written before it hold [partition, offset].
	FieldPosition = "_pos"
	// FieldDeletedAt holds, on a tombstone, when the indexer wrote it
	// (milliseconds since the epoch, the indexer's clock when it parsed the
	// delete): [PurgeTombstones] removes tombstones older than the horizon.
	FieldDeletedAt = index.FieldDeletedAt
)

// Buckets is the number of id ranges reconciliation compares.
const Buckets = 1024

// tombstoneDoc is the body written for a delete: a real document, so the
// engine keeps its external version forever (see doc.go).
var tombstoneDoc = []byte(`{"` + FieldDeleted + `":true}`)

func hash31(s string) int64 {
	sum := md5.Sum([]byte(s))
	return int64(binary.BigEndian.Uint32(sum[:4]) & 0x7fffffff)
}

// Bucket returns the bucket of an id, 0 ≤ Bucket < Buckets. Package
// reconcile computes the same hash in SQL.
func Bucket(id string) int { return int(hash31(id) % Buckets) }

// IDV returns a 31-bit hash of (id, version, deleted, processor version).
// Package reconcile computes the same hash in SQL. Without a processor
// version it is the hash of (id, version, deleted), as before processor
// versions were compared.
func IDV(id string, version int64, deleted bool, pv string) int64 {
	d := "0"
	if deleted {
		d = "1"
	}
	s := id + ":" + strconv.FormatInt(version, 10) + ":" + d
	if pv != "" {
		s += ":" + pv
	}
	return hash31(s)
}

// appendDocument appends the document as indexed: the body plus the fields
// package reconcile aggregates on (the id's bucket and a hash of id,
// version, deleted-ness and processor version), so reconciliation compares
// summaries instead of scanning documents. They are added while the bulk
// body is written, which saves copying every document once more.
func appendDocument(dst []byte, d *doc) []byte {
	dst = appendReconcileFields(dst, d.body, d.bucket, d.idv, d.pv)
	if d.op == opDelete {
		dst = append(dst[:len(dst)-1], `,"`+FieldDeletedAt+`":`...)
		dst = strconv.AppendInt(dst, d.deletedAt, 10)
		dst = append(dst, '}')
	}
	if len(d.aggType) > 0 {
		dst = append(dst[:len(dst)-1], `,"`+FieldAggregateType+`":`...)
		dst = appendJSONBytes(dst, d.aggType)
		dst = append(dst, '}')
	}
	if !d.withPosition {
		return dst
	}
	dst = append(dst[:len(dst)-1], `,"`+FieldPosition+`":[`...)
	dst = strconv.AppendInt(dst, int64(d.msg.Partition), 10)
	dst = append(dst, ',')
	dst = strconv.AppendInt(dst, d.msg.Offset, 10)
	dst = append(dst, ',')
	dst = strconv.AppendInt(dst, topicTag(d.msg.Topic), 10)
	return append(dst, "]}"...)
}

// appendReconcileFields appends obj, a JSON object, with the reconcile
// fields added (the processor version only when there is one).
func appendReconcileFields(dst, obj []byte, bucket int, idv int64, pv string) []byte {
	start := len(dst)
	dst = append(dst, obj[:len(obj)-1]...) // without the closing brace
	if len(bytes.TrimSpace(dst[start+1:])) > 0 {
		dst = append(dst, ',')
	}
	dst = append(dst, `"`+FieldBucket+`":`...)
	dst = strconv.AppendInt(dst, int64(bucket), 10)
	dst = append(dst, `,"`+FieldIDV+`":`...)
	dst = strconv.AppendInt(dst, idv, 10)
	if pv != "" {
		dst = append(dst, `,"`+FieldPV+`":`...)
		b, _ := json.Marshal(pv) // a Go string always marshals
		dst = append(dst, b...)
	}
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

// topicTag is what FieldPosition holds of the topic: 53 bits of its FNV-1a
// hash (a number any JSON reader keeps exact).
func topicTag(topic string) int64 {
	h := fnv.New64a()
	h.Write([]byte(topic))
	return int64(h.Sum64() & (1<<53 - 1))
}
