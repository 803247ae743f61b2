package outbox

import (
	"context"

	"go.opentelemetry.io/otel/trace"

	"github.com/outboxrelay/outboxrelay/internal/tracing"
)

// startPublishSpan starts the span of one publish batch, linked to the
// traceparent of each of its events (see internal/tracing); a no-op span
// while tracing is off. The events' own traceparent header goes to Kafka
// unchanged: it is the message's creation context the indexer links to.
func startPublishSpan(ctx context.Context, all []pendingEvent) (context.Context, trace.Span) {
	return tracing.StartLinked(ctx, "outbox.publish", trace.SpanKindProducer, len(all), func(i int) string {
		for _, h := range all[i].msg.Headers {
			if h.Key == HeaderTraceParent {
				return string(h.Value)
			}
		}
		return ""
	})
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
