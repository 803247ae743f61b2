package outbox

import (
	"context"
	"errors"
	"testing"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxrelay/outboxrelay/internal/tracing"
)

const sampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

// The send and publish spans cost nothing while tracing is off (the
// default), and the record's traceparent stays the event's.
func TestPublishSpanAllocatesNothingWhenTracingIsOff(t *testing.T) {
	all := make([]pendingEvent, 100)
	for i := range all {
		all[i].msg = kafka.Message{Headers: []kafka.Header{{Key: HeaderTraceParent, Value: []byte(sampled)}}}
	}
	ctx := context.Background()
	require.Zero(t, testing.AllocsPerRun(100, func() {
		startSendSpans(ctx, all)
		_, span := startPublishSpan(ctx, all)
		span.End()
		endSendSpans(all, nil)
	}))
	require.Equal(t, sampled, string(all[0].msg.Headers[0].Value))
}

// With tracing on, an event with a sampled traceparent gets a producer span
// that is a child of it, and the record carries that span's traceparent;
// other events keep theirs. The publish span links to the producer spans.
// Not parallel: the tracer is process-wide.
func TestSendSpanContinuesTheEventsTrace(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tracing.Use(sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp)))
	t.Cleanup(func() { tracing.Use(nil) })
	const unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
	event := func(tp string) pendingEvent {
		pe := pendingEvent{ev: &storedEvent{eventID: []byte("e")}, msg: kafka.Message{Topic: "t", Key: []byte("k")}}
		if tp != "" {
			pe.msg.Headers = []kafka.Header{{Key: HeaderSpecVersion, Value: specVersionValue}, {Key: HeaderTraceParent, Value: []byte(tp)}}
		}
		return pe
	}
	all := []pendingEvent{event(sampled), event(unsampled), event(""), event(sampled)}
	all[3].err = errors.New("too large")
	ctx := context.Background()
	startSendSpans(ctx, all)
	_, publish := startPublishSpan(ctx, all)
	publish.End()
	require.Equal(t, unsampled, string(all[1].msg.Headers[1].Value))
	sent := []string{string(all[0].msg.Headers[1].Value), string(all[3].msg.Headers[1].Value)}
	endSendSpans(all, nil)

	parent, _ := tracing.Parse(sampled)
	var send []tracetest.SpanStub
	var links []sdktrace.Link
	for _, s := range exp.GetSpans() {
		switch s.Name {
		case "outbox.send":
			send = append(send, s)
		case "outbox.publish":
			links = s.Links
		}
	}
	require.Len(t, send, 2)
	for i, s := range send {
		require.Equal(t, trace.SpanKindProducer, s.SpanKind)
		require.Equal(t, parent.TraceID(), s.SpanContext.TraceID())
		require.Equal(t, parent.SpanID(), s.Parent.SpanID())
		require.Equal(t, tracing.Format(s.SpanContext), sent[i], "the record's traceparent is its send span")
	}
	require.Equal(t, "Unset", send[0].Status.Code.String())
	require.Equal(t, "Error", send[1].Status.Code.String())
	require.Len(t, links, 3) // two send spans and the unsampled event's context
	require.Equal(t, send[0].SpanContext.SpanID(), links[0].SpanContext.SpanID())
}

// A sampler that ignores the parent can drop the send span of a sampled
// event: the record then keeps the event's own traceparent, so the
// indexer continues a span that was exported rather than one that was not.
func TestAnUnsampledSendSpanLeavesTheEventsTraceParent(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tracing.Use(sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(sdktrace.NeverSample())))
	t.Cleanup(func() { tracing.Use(nil) })
	all := []pendingEvent{{ev: &storedEvent{eventID: []byte("e")}, msg: kafka.Message{Topic: "t", Key: []byte("k"),
		Headers: []kafka.Header{{Key: HeaderTraceParent, Value: []byte(sampled)}}}}}
	startSendSpans(context.Background(), all)
	require.Equal(t, sampled, string(all[0].msg.Headers[0].Value))
	endSendSpans(all, nil)
	require.Empty(t, exp.GetSpans())
}
