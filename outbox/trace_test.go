package outbox_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/tracing"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// With tracing on, Enqueue stores the caller's traceparent for an event
// whose headers have none, and keeps one the application put there. Not
// parallel: the tracer is process-wide.
func TestEnqueueCarriesTheCallersTraceParent(t *testing.T) {
	tracing.Use(sdktrace.NewTracerProvider(sdktrace.WithSyncer(tracetest.NewInMemoryExporter())))
	t.Cleanup(func() { tracing.Use(nil) })
	pool := stack.Pool(t, stack.Database(t))
	ctx, span := tracing.Start(context.Background(), "application")
	defer span.End()
	const own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	_, err := outbox.Enqueue(ctx, pool,
		outbox.Event{ID: outbox.EventID("s", "1", 1, "v1"), Topic: "t", AggregateID: "1", AggregateVersion: 1, Payload: json.RawMessage(`{}`)},
		outbox.Event{ID: outbox.EventID("s", "2", 1, "v1"), Topic: "t", AggregateID: "2", AggregateVersion: 1, Payload: json.RawMessage(`{}`), Headers: map[string]string{"x": "y"}},
		outbox.Event{ID: outbox.EventID("s", "3", 1, "v1"), Topic: "t", AggregateID: "3", AggregateVersion: 1, Payload: json.RawMessage(`{}`), Headers: map[string]string{outbox.HeaderTraceParent: own}},
	)
	require.NoError(t, err)
	got := map[string]map[string]string{}
	rows, err := pool.Query(context.Background(), `SELECT aggregate_id, headers FROM outbox_events`)
	require.NoError(t, err)
	for rows.Next() {
		var id string
		var h map[string]string
		require.NoError(t, rows.Scan(&id, &h))
		got[id] = h
	}
	require.NoError(t, rows.Err())
	mine := tracing.TraceParent(ctx)
	require.NotEmpty(t, mine)
	require.Equal(t, map[string]map[string]string{
		"1": {outbox.HeaderTraceParent: mine},
		"2": {"x": "y", outbox.HeaderTraceParent: mine},
		"3": {outbox.HeaderTraceParent: own},
	}, got)
}
