package tracing

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// Off (the default, and Setup without OTEL_EXPORTER_OTLP_ENDPOINT): no
// span, no traceparent, and nothing allocated on the hot paths.
func TestOffByDefaultCostsNoAllocation(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
	stop, err := Setup(context.Background(), "test")
	require.NoError(t, err)
	require.NoError(t, stop(context.Background()))
	require.False(t, Enabled())
	ctx := context.Background()
	called := false
	allocs := testing.AllocsPerRun(100, func() {
		c, span := Start(ctx, "x")
		span.End()
		c, span = StartLinked(c, "y", trace.SpanKindProducer, 10, func(int) trace.SpanContext { called = true; return trace.SpanContext{} })
		span.End()
		msg := StartMessage(c, "z", trace.SpanKindConsumer, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
		if msg != nil {
			t.Fatal("a message span while off")
		}
		End(msg, nil)
		if TraceParent(c) != "" || Arg(c) != nil {
			t.Fatal("a traceparent while off")
		}
	})
	require.Zero(t, allocs)
	require.False(t, called, "links are read while off")
}

func TestSetupRefusesAnUnsupportedProtocol(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
	_, err := Setup(context.Background(), "test")
	require.ErrorContains(t, err, "OTEL_EXPORTER_OTLP_PROTOCOL")
	require.False(t, Enabled())
}

func TestLinkedSpanLinksEachDistinctContext(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	Use(sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp)))
	t.Cleanup(func() { Use(nil) })
	ctx, chunk := Start(context.Background(), "chunk")
	tp := TraceParent(ctx)
	chunk.End()
	sc, ok := Parse(tp)
	require.True(t, ok, tp)
	require.Equal(t, chunk.SpanContext().SpanID(), sc.SpanID())
	_, bad := Parse("garbage")
	require.False(t, bad)
	contexts := []trace.SpanContext{sc, {}, sc}
	_, span := StartLinked(context.Background(), "publish", trace.SpanKindProducer, len(contexts), func(i int) trace.SpanContext { return contexts[i] })
	span.End()
	spans := exp.GetSpans()
	require.Len(t, spans, 2)
	require.Len(t, spans[1].Links, 1)
	require.Equal(t, sc.SpanID(), spans[1].Links[0].SpanContext.SpanID())
}

// A message span continues the message's trace as a child of its
// traceparent; a message without a sampled traceparent gets none.
func TestMessageSpanIsAChildOfTheMessagesTraceParent(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	Use(sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp)))
	t.Cleanup(func() { Use(nil) })
	ctx, chunk := Start(context.Background(), "chunk")
	parent := TraceParent(ctx)
	chunk.End()

	span := StartMessage(context.Background(), "send", trace.SpanKindProducer, parent)
	require.NotNil(t, span)
	child := Format(span.SpanContext())
	End(span, errors.New("rejected"))
	spans := exp.GetSpans()
	require.Len(t, spans, 2)
	send := spans[1]
	require.Equal(t, chunk.SpanContext().TraceID(), send.SpanContext.TraceID())
	require.Equal(t, chunk.SpanContext().SpanID(), send.Parent.SpanID())
	require.True(t, send.Parent.IsRemote())
	require.Equal(t, trace.SpanKindProducer, send.SpanKind)
	require.Equal(t, codes.Error, send.Status.Code)
	sc, ok := Parse(child)
	require.True(t, ok, child)
	require.Equal(t, send.SpanContext.SpanID(), sc.SpanID())

	for _, tc := range []struct {
		name   string
		parent string
	}{
		{name: "none", parent: ""},
		{name: "malformed", parent: "garbage"},
		{name: "not sampled", parent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Nil(t, StartMessage(context.Background(), "send", trace.SpanKindProducer, tc.parent))
		})
	}
	require.Len(t, exp.GetSpans(), 2)
}

// An endpoint turns tracing on: spans record, traceparents are written,
// and shutdown turns it off again.
func TestSetupWithAnEndpointTurnsTracingOn(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
	t.Setenv("OTEL_TRACES_SAMPLER", "always_on")
	stop, err := Setup(context.Background(), "test")
	require.NoError(t, err)
	require.True(t, Enabled())
	ctx, span := Start(context.Background(), "x")
	require.True(t, span.IsRecording())
	_, ok := Parse(TraceParent(ctx))
	require.True(t, ok)
	span.End()
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = stop(sctx) // nothing listens at the endpoint
	require.False(t, Enabled())
}
