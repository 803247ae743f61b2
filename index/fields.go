package index

// The document fields the lifecycle reads: the read alias filters on them,
// and a move counts and copies documents by them. Package sink writes them
// (and names them in its own document format).
const (
	// FieldDeleted marks a delete tombstone document. The read alias filters
	// documents with FieldDeleted = true out of searches.
	FieldDeleted = "_deleted"
	// FieldPV holds the processor version that built the document (absent
	// for events that carry none).
	FieldPV = "_pv"
	// FieldAggregateType holds the event's ce_aggregatetype: whose document
	// it is when several jobs write one alias.
	FieldAggregateType = "_aggregate_type"
	// FieldDeletedAt holds, on a tombstone, when the indexer wrote it
	// (milliseconds since the epoch).
	FieldDeletedAt = "_deleted_at"
)
