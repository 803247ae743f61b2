// Package tracing is the OpenTelemetry setup the three services share, and
// the few calls their hot paths make.
//
// Tracing is off unless OTEL_EXPORTER_OTLP_ENDPOINT (or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) names a collector: then [Setup]
// installs an SDK tracer provider that exports spans over OTLP/HTTP, sampled
// as OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG say (the SDK reads them;
// default parentbased_always_on). OTEL_SDK_DISABLED=true keeps it off. While
// off, [Start] and [StartLinked] return the caller's context and a no-op
// span without allocating, [StartMessage] returns nil, and [TraceParent]
// returns "".
//
// A row's trace is one trace, as the OpenTelemetry messaging conventions
// build it: the batcher starts a span per chunk and writes its W3C
// traceparent into each outbox event's headers; the publisher starts a
// producer span per event as a child of that context and sends its
// traceparent in the Kafka record's traceparent header; the indexer starts
// a consumer span per message as a child of the header's context, ended
// when the message is resolved. The batch spans (the publisher's per
// publish batch, the indexer's per bulk request) carry events of many
// traces, so they start traces of their own and link to each message's
// span.
package tracing

import (
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"
)

// Name is the instrumentation scope of every span.
const Name = "github.com/outboxrelay/outboxrelay"

// tracer is nil while tracing is off: the hot paths test it and do nothing.
var tracer atomic.Pointer[trace.Tracer]

// Enabled reports whether spans are being made.
func Enabled() bool { return tracer.Load() != nil }

// Use makes spans with tp from now on; nil turns tracing off. Tests pass a
// provider with an in-memory exporter.
func Use(tp trace.TracerProvider) {
	if tp == nil {
		tracer.Store(nil)
		return
	}
	t := tp.Tracer(Name)
	tracer.Store(&t)
}

// Setup turns tracing on when the environment asks for it (see the package
// doc) and returns the function that flushes and stops the exporter; a
// no-op when tracing stays off. service is the service.name resource
// attribute unless OTEL_SERVICE_NAME sets one.
func Setup(ctx context.Context, service string) (shutdown func(context.Context) error, err error) {
	noop := func(context.Context) error { return nil }
	if strings.EqualFold(os.Getenv("OTEL_SDK_DISABLED"), "true") {
		return noop, nil
	}
	if os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" && os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" {
		return noop, nil
	}
	for _, name := range []string{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"} {
		if v := os.Getenv(name); v != "" && v != "http/protobuf" {
			return nil, fmt.Errorf("%s=%q: only http/protobuf is supported", name, v)
		}
	}
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("OTLP trace exporter (OTEL_EXPORTER_OTLP_ENDPOINT): %w", err)
	}
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(semconv.ServiceName(service)))
	if err != nil {
		return nil, fmt.Errorf("trace resource: %w", err)
	}
	if env, envErr := resource.New(ctx, resource.WithFromEnv()); envErr == nil {
		if merged, mergeErr := resource.Merge(res, env); mergeErr == nil {
			res = merged
		}
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	Use(tp)
	return func(ctx context.Context) error {
		Use(nil)
		return tp.Shutdown(ctx)
	}, nil
}

// Start starts span name as a child of ctx's span. While tracing is off it
// returns ctx and ctx's span (a no-op one) without allocating.
func Start(ctx context.Context, name string) (context.Context, trace.Span) {
	t := tracer.Load()
	if t == nil {
		return ctx, trace.SpanFromContext(ctx)
	}
	return (*t).Start(ctx, name)
}

// StartLinked starts span name with a link to each of the n span contexts
// sc(i) returns (an invalid one: no link; one link per distinct context);
// the batch span of the publisher (kind producer) and the indexer
// (consumer). n is recorded as messaging.batch.message_count. While
// tracing is off sc is never called.
func StartLinked(ctx context.Context, name string, kind trace.SpanKind, n int, sc func(i int) trace.SpanContext) (context.Context, trace.Span) {
	t := tracer.Load()
	if t == nil {
		return ctx, trace.SpanFromContext(ctx)
	}
	links := make([]trace.Link, 0, n)
	type id struct {
		trace trace.TraceID
		span  trace.SpanID
	}
	seen := make(map[id]struct{}, n)
	for i := range n {
		c := sc(i)
		if !c.IsValid() {
			continue
		}
		k := id{c.TraceID(), c.SpanID()}
		if _, dup := seen[k]; dup {
			continue // one link per context: events without a span of their own share their chunk's
		}
		seen[k] = struct{}{}
		links = append(links, trace.Link{SpanContext: c})
	}
	return (*t).Start(ctx, name, trace.WithLinks(links...), trace.WithSpanKind(kind),
		trace.WithAttributes(attribute.Int("messaging.batch.message_count", n)))
}

// StartMessage starts span name of one message (kind producer or consumer)
// as a child of parent, the W3C traceparent the message carries. It returns
// nil, without allocating, when tracing is off or parent is empty,
// malformed or not sampled: such a message gets no span, and its
// traceparent travels on unchanged. End the span with [End].
func StartMessage(ctx context.Context, name string, kind trace.SpanKind, parent string) trace.Span {
	t := tracer.Load()
	if t == nil || parent == "" {
		return nil
	}
	sc, ok := Parse(parent)
	if !ok || !sc.IsSampled() {
		return nil
	}
	_, span := (*t).Start(trace.ContextWithRemoteSpanContext(ctx, sc), name, trace.WithSpanKind(kind))
	return span
}

// End ends span, a [StartMessage] span or nil, with an error status when
// err is not nil.
func End(span trace.Span, err error) {
	if span == nil {
		return
	}
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// TraceParent is the W3C traceparent of ctx's span: "" when tracing is off
// or ctx has no valid span.
func TraceParent(ctx context.Context) string {
	if tracer.Load() == nil {
		return ""
	}
	return Format(trace.SpanContextFromContext(ctx))
}

// Format is the W3C traceparent of sc: "" when sc is not valid.
func Format(sc trace.SpanContext) string {
	if !sc.IsValid() {
		return ""
	}
	tid, sid := sc.TraceID(), sc.SpanID()
	return "00-" + hex.EncodeToString(tid[:]) + "-" + hex.EncodeToString(sid[:]) + "-" + hex.EncodeToString([]byte{byte(sc.TraceFlags())})
}

// Arg is [TraceParent] as a statement parameter: nil (SQL NULL) for none.
func Arg(ctx context.Context) any {
	if tp := TraceParent(ctx); tp != "" {
		return tp
	}
	return nil
}

// Parse reads a W3C traceparent header value.
func Parse(traceparent string) (trace.SpanContext, bool) {
	if traceparent == "" {
		return trace.SpanContext{}, false
	}
	ctx := propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier{"traceparent": traceparent})
	sc := trace.SpanContextFromContext(ctx)
	return sc, sc.IsValid()
}
