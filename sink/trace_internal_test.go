package sink

import (
	"context"
	"testing"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxrelay/outboxrelay/internal/tracing"
)

const sampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

// The message and bulk spans cost nothing while tracing is off (the
// default).
func TestBulkSpanAllocatesNothingWhenTracingIsOff(t *testing.T) {
	docs := make([]*doc, 100)
	for i := range docs {
		docs[i] = &doc{msg: kafka.Message{Headers: []kafka.Header{{Key: "traceparent", Value: []byte(sampled)}}}}
	}
	ctx := context.Background()
	require.Zero(t, testing.AllocsPerRun(100, func() {
		startProcessSpans(ctx, docs)
		_, span := startBulkSpan(ctx, docs)
		span.End()
		endProcessSpans(docs, nil)
	}))
}

// With tracing on, each message with a sampled traceparent gets a consumer
// span that is a child of it, ended when the batch is resolved (with the
// dead-letter reason for a dead-lettered one), and the bulk span links to
// those spans. Not parallel: the tracer is process-wide.
func TestProcessSpanIsAChildOfTheMessagesTraceParent(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tracing.Use(sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp)))
	t.Cleanup(func() { tracing.Use(nil) })
	withHeader := func(tp string) *doc {
		return &doc{msg: kafka.Message{Topic: "t", Partition: 1, Offset: 7, Key: []byte("k"), Headers: []kafka.Header{{Key: "traceparent", Value: []byte(tp)}}}}
	}
	docs := []*doc{
		withHeader(sampled),
		withHeader("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"), // not sampled
		{msg: kafka.Message{Topic: "t"}},                                      // no header
		withHeader(sampled),
	}
	docs[3].poison = &itemError{Code: CodeInvalidJSON, Reason: "bad"}
	ctx := context.Background()
	startProcessSpans(ctx, docs)
	require.NotNil(t, docs[0].span)
	require.Nil(t, docs[1].span)
	require.Nil(t, docs[2].span)
	require.NotNil(t, docs[3].span)
	_, bulk := startBulkSpan(ctx, docs)
	bulk.End()
	endProcessSpans(docs, nil)
	require.Nil(t, docs[0].span, "ended and forgotten")

	parent, _ := tracing.Parse(sampled)
	var process []tracetest.SpanStub
	var links []sdktrace.Link
	for _, s := range exp.GetSpans() {
		switch s.Name {
		case "sink.process":
			process = append(process, s)
		case "sink.bulk":
			links = s.Links
		}
	}
	require.Len(t, process, 2)
	for _, s := range process {
		require.Equal(t, trace.SpanKindConsumer, s.SpanKind)
		require.Equal(t, parent.TraceID(), s.SpanContext.TraceID())
		require.Equal(t, parent.SpanID(), s.Parent.SpanID())
	}
	require.Equal(t, "Unset", process[0].Status.Code.String())
	require.Equal(t, "Error", process[1].Status.Code.String())
	// Links: the two process spans and the unsampled message's own context.
	require.Len(t, links, 3)
	require.Equal(t, process[0].SpanContext.SpanID(), links[0].SpanContext.SpanID())
	require.Equal(t, process[1].SpanContext.SpanID(), links[2].SpanContext.SpanID())
}
