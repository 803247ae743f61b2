package tracing

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
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
		c, span = StartLinked(c, "y", trace.SpanKindProducer, 10, func(int) string { called = true; return "" })
		span.End()
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

func TestLinkedSpanLinksEachDistinctTraceParent(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	Use(sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp)))
	t.Cleanup(func() { Use(nil) })
	ctx, chunk := Start(context.Background(), "chunk")
	tp := TraceParent(ctx)
	chunk.End()
	sc, ok := Parse(tp)
	require.True(t, ok, tp)
	require.Equal(t, chunk.SpanContext().SpanID(), sc.SpanID())
	parents := []string{tp, "", "garbage", tp}
	_, span := StartLinked(context.Background(), "publish", trace.SpanKindProducer, len(parents), func(i int) string { return parents[i] })
	span.End()
	spans := exp.GetSpans()
	require.Len(t, spans, 2)
	require.Len(t, spans[1].Links, 1)
	require.Equal(t, sc.SpanID(), spans[1].Links[0].SpanContext.SpanID())
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
