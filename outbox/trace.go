package outbox

import (
	"cmp"
	"context"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxrelay/outboxrelay/internal/tracing"
)

// startSendSpans starts, while tracing is on, the producer span of each
// event whose traceparent is sampled, as a child of that context (the
// event's chunk, or the application's span), and puts the span's own
// traceparent into the record's header when it is sampled: the indexer
// continues the trace from it. The spans end with [endSendSpans] once the batch is
// acknowledged, dead-lettered or abandoned.
func startSendSpans(ctx context.Context, all []pendingEvent) {
	if !tracing.Enabled() {
		return
	}
	for i := range all {
		pe := &all[i]
		h := traceParentHeader(&pe.msg)
		if h == nil {
			continue
		}
		span := tracing.StartMessage(ctx, "outbox.send", trace.SpanKindProducer, string(h.Value))
		if span == nil {
			continue
		}
		span.SetAttributes(
			attribute.String("messaging.system", "kafka"),
			attribute.String("messaging.operation.type", "send"),
			attribute.String("messaging.destination.name", pe.msg.Topic),
			attribute.String("messaging.message.id", string(pe.ev.eventID)),
			attribute.String("messaging.kafka.message.key", string(pe.msg.Key)),
		)
		// A sampler that ignores the parent may drop this span: the record
		// then keeps the event's own traceparent, so the indexer still
		// continues a span that is exported.
		if span.SpanContext().IsSampled() {
			h.Value = []byte(tracing.Format(span.SpanContext()))
		}
		pe.span = span
	}
}

// endSendSpans ends the events' producer spans: with the event's own error
// when it is dead, with err when the batch was not sent.
func endSendSpans(all []pendingEvent, err error) {
	for i := range all {
		pe := &all[i]
		if pe.span == nil {
			continue
		}
		tracing.End(pe.span, cmp.Or(pe.err, err))
		pe.span = nil
	}
}

// startPublishSpan starts the span of one publish batch, linked to each
// event's producer span, or to the event's own traceparent when it has
// none (see internal/tracing); a no-op span while tracing is off.
func startPublishSpan(ctx context.Context, all []pendingEvent) (context.Context, trace.Span) {
	return tracing.StartLinked(ctx, "outbox.publish", trace.SpanKindProducer, len(all), func(i int) trace.SpanContext {
		if span := all[i].span; span != nil {
			return span.SpanContext()
		}
		if h := traceParentHeader(&all[i].msg); h != nil {
			sc, _ := tracing.Parse(string(h.Value))
			return sc
		}
		return trace.SpanContext{}
	})
}

// traceParentHeader is the record's traceparent header, nil when it has
// none.
func traceParentHeader(m *kafka.Message) *kafka.Header {
	for i := range m.Headers {
		if m.Headers[i].Key == HeaderTraceParent {
			return &m.Headers[i]
		}
	}
	return nil
}

// withTraceParent is the headers Enqueue stores for an event: the
// application's own, with the traceparent of ctx's span added when tracing
// is on and the application put none there.
func withTraceParent(ctx context.Context, headers map[string]string) map[string]string {
	if _, ok := headers[HeaderTraceParent]; ok {
		return headers
	}
	tp := tracing.TraceParent(ctx)
	if tp == "" {
		return headers
	}
	out := make(map[string]string, len(headers)+1)
	for k, v := range headers {
		out[k] = v
	}
	out[HeaderTraceParent] = tp
	return out
}
