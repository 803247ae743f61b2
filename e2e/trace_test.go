package e2e

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/tracing"
	"github.com/outboxrelay/outboxrelay/outbox"
	"github.com/outboxrelay/outboxrelay/sink"
)

// TestTraceFollowsARowThroughTheThreeStages drives the batcher, the
// publisher and the indexer in this process against the real servers, with
// the SDK's in-memory exporter: a row's trace is one trace, the batcher's
// batch.chunk span (whose traceparent the row's outbox event carries), the
// publisher's outbox.send span for the row as its child, and the indexer's
// sink.process span for the row as the child of that; the batch spans
// (outbox.publish, sink.bulk) link to the row's message spans. Not
// parallel: the tracer is process-wide.
func TestTraceFollowsARowThroughTheThreeStages(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	tracing.Use(tp)
	t.Cleanup(func() { tracing.Use(nil) })

	dbURL := stack.Database(t)
	pool := stack.Pool(t, dbURL)
	_, err := pool.Exec(ctx, batch.DemoSchemaSQL)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO source_records (id, created_at, tenant_id, payload)
SELECT g, timestamptz '2024-01-01 00:00:00+00' + g * interval '1 second', 't1', jsonb_build_object('title', 'Title ' || g, 'body', 'b', 'tags', jsonb_build_array('a'))
FROM generate_series(1, 3) g`)
	require.NoError(t, err)
	brokers, esURL := stack.KafkaBrokers(t), stack.ElasticsearchURL(t)
	topic, alias := stack.UniqueName("trace"), stack.UniqueName("trace")
	createTopic(t, brokers, topic, 2)
	es, err := index.NewClient(esURL)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = es.DeleteIndex(alias + "_v*").Do(context.Background()) })

	// Batcher: one chunk.
	spec := batch.DemoSpec()
	spec.Topic = topic
	r, err := batch.NewRunner(pool, spec, batch.Config{})
	require.NoError(t, err)
	_, err = r.Run(ctx, ctx)
	require.NoError(t, err)
	var tp2 string
	require.NoError(t, pool.QueryRow(ctx, `SELECT headers->>'traceparent' FROM outbox_event_members WHERE aggregate_id = '2'`).Scan(&tp2))
	row, ok := tracing.Parse(tp2)
	require.True(t, ok, "outbox event of row 2: traceparent header %q", tp2)
	spanByName := func(name string) []tracetest.SpanStub {
		var out []tracetest.SpanStub
		for _, s := range exp.GetSpans() {
			if s.Name == name {
				out = append(out, s)
			}
		}
		return out
	}
	chunks := spanByName("batch.chunk")
	require.NotEmpty(t, chunks)
	require.True(t, hasSpan(chunks, row), "the row's traceparent is a batch.chunk span: %s", tp2)

	// Publisher and indexer until the row is in the index.
	stages, stop := context.WithCancel(ctx)
	defer stop()
	pub, err := outbox.NewPublisher(pool, outbox.Config{Brokers: brokers})
	require.NoError(t, err)
	ix, err := sink.New(sink.Config{Brokers: brokers, URL: esURL, Topic: topic, Group: topic + "-indexer", Alias: alias})
	require.NoError(t, err)
	done := make(chan error, 2)
	go func() { done <- pub.Run(stages) }()
	go func() { done <- ix.Run(stages) }()
	require.Eventually(t, func() bool {
		res, err := es.Get().Index(alias).Id("2").Do(ctx)
		return err == nil && res.Found
	}, 2*time.Minute, 100*time.Millisecond, "row 2 never reached the index")
	stop()
	for range 2 {
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			require.NoError(t, err)
		}
	}

	// One trace: chunk -> outbox.send -> sink.process, for the row's key.
	send := ofKey(spanByName("outbox.send"), "2")
	require.Len(t, send, 1, "outbox.send spans of row 2")
	require.Equal(t, trace.SpanKindProducer, send[0].SpanKind)
	require.Equal(t, row.TraceID(), send[0].SpanContext.TraceID(), "outbox.send is in the row's trace")
	require.Equal(t, row.SpanID(), send[0].Parent.SpanID(), "outbox.send is a child of the chunk span")
	process := ofKey(spanByName("sink.process"), "2")
	require.NotEmpty(t, process, "sink.process spans of row 2")
	for _, p := range process {
		require.Equal(t, trace.SpanKindConsumer, p.SpanKind)
		require.Equal(t, row.TraceID(), p.SpanContext.TraceID(), "sink.process is in the row's trace")
		require.Equal(t, send[0].SpanContext.SpanID(), p.Parent.SpanID(), "sink.process is a child of outbox.send")
	}
	publish := spanByName("outbox.publish")
	require.True(t, linksTo(publish, send[0].SpanContext), "no outbox.publish span links to the row's outbox.send span (%d publish spans)", len(publish))
	bulk := spanByName("sink.bulk")
	require.True(t, linksTo(bulk, process[0].SpanContext), "no sink.bulk span links to the row's sink.process span (%d bulk spans)", len(bulk))
}

// ofKey is the spans of the message with Kafka key key.
func ofKey(spans []tracetest.SpanStub, key string) []tracetest.SpanStub {
	var out []tracetest.SpanStub
	for _, s := range spans {
		for _, a := range s.Attributes {
			if a.Key == "messaging.kafka.message.key" && a.Value.AsString() == key {
				out = append(out, s)
			}
		}
	}
	return out
}

func hasSpan(spans []tracetest.SpanStub, sc trace.SpanContext) bool {
	for _, s := range spans {
		if s.SpanContext.TraceID() == sc.TraceID() && s.SpanContext.SpanID() == sc.SpanID() {
			return true
		}
	}
	return false
}

func linksTo(spans []tracetest.SpanStub, sc trace.SpanContext) bool {
	for _, s := range spans {
		for _, l := range s.Links {
			if l.SpanContext.TraceID() == sc.TraceID() && l.SpanContext.SpanID() == sc.SpanID() {
				return true
			}
		}
	}
	return false
}
