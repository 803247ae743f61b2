package sink

import (
	"context"

	"go.opentelemetry.io/otel/trace"

	"github.com/outboxrelay/outboxrelay/internal/tracing"
)

// startBulkSpan starts the span of one bulk request, linked to the
// traceparent header of each of its messages (see internal/tracing); a
// no-op span while tracing is off.
func startBulkSpan(ctx context.Context, docs []*doc) (context.Context, trace.Span) {
	return tracing.StartLinked(ctx, "sink.bulk", trace.SpanKindConsumer, len(docs), func(i int) string {
		return traceparent(docs[i].msg)
	})
}
