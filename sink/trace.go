package sink

import (
	"context"
	"strconv"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxrelay/outboxrelay/internal/tracing"
)

// startProcessSpans starts, while tracing is on, the consumer span of each
// message whose traceparent header is sampled, as a child of that context
// (the publisher's producer span): the row's trace goes on into the
// indexer. The spans end with [endProcessSpans] once the batch is resolved.
func startProcessSpans(ctx context.Context, docs []*doc) {
	if !tracing.Enabled() {
		return
	}
	for _, d := range docs {
		span := tracing.StartMessage(ctx, "sink.process", trace.SpanKindConsumer, traceparent(d.msg))
		if span == nil {
			continue
		}
		span.SetAttributes(
			attribute.String("messaging.system", "kafka"),
			attribute.String("messaging.operation.type", "process"),
			attribute.String("messaging.destination.name", d.msg.Topic),
			attribute.String("messaging.destination.partition.id", strconv.Itoa(d.msg.Partition)),
			attribute.Int64("messaging.kafka.offset", d.msg.Offset),
			attribute.String("messaging.kafka.message.key", string(d.msg.Key)),
		)
		d.span = span
	}
}

// endProcessSpans ends the messages' consumer spans: with the message's
// dead-letter reason when it was dead-lettered, with err when the batch
// could not be resolved.
func endProcessSpans(docs []*doc, err error) {
	for _, d := range docs {
		if d.span == nil {
			continue
		}
		e := err
		if e == nil && d.poison != nil {
			e = d.poison
		}
		tracing.End(d.span, e)
		d.span = nil
	}
}

// startBulkSpan starts the span of one bulk request, linked to each
// message's consumer span, or to its traceparent header when it has none
// (see internal/tracing); a no-op span while tracing is off.
func startBulkSpan(ctx context.Context, docs []*doc) (context.Context, trace.Span) {
	return tracing.StartLinked(ctx, "sink.bulk", trace.SpanKindConsumer, len(docs), func(i int) trace.SpanContext {
		if span := docs[i].span; span != nil {
			return span.SpanContext()
		}
		sc, _ := tracing.Parse(traceparent(docs[i].msg))
		return sc
	})
}
