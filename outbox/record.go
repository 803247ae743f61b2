package outbox

// The Kafka record the publisher writes for an outbox event, in CloudEvents
// binary mode (https://github.com/cloudevents/spec kafka-protocol-binding):
//
//	key     = aggregate id
//	value   = the document (JSON); nil for a delete (a Kafka tombstone)
//	headers = ce_specversion "1.0", ce_id = event id, ce_source,
//	          ce_type = "outboxrelay.<event type>", ce_subject = aggregate id,
//	          ce_time (RFC 3339), content-type, ce_aggregateversion (decimal),
//	          ce_aggregatetype, and traceparent when the event carries one
//	          (while tracing is on and the event's context is sampled, the
//	          traceparent of the publisher's span for the event, a child of
//	          the event's).
//
// The indexer reads the version and the event type from these headers, and
// ce_processorversion, which the batcher puts into its events' own headers,
// to route a document to its processor version's index generation.
const (
	HeaderSpecVersion      = "ce_specversion"
	HeaderID               = "ce_id"
	HeaderSource           = "ce_source"
	HeaderType             = "ce_type"
	HeaderSubject          = "ce_subject"
	HeaderTime             = "ce_time"
	HeaderContentType      = "content-type"
	HeaderAggregateVersion = "ce_aggregateversion"
	HeaderAggregateType    = "ce_aggregatetype"
	HeaderTraceParent      = "traceparent"
	HeaderProcessorVersion = "ce_processorversion"

	// SpecVersion is the CloudEvents version written in ce_specversion.
	SpecVersion = "1.0"
	// TypePrefix prefixes the event type in ce_type: "outboxrelay.upsert".
	TypePrefix = "outboxrelay."
)
