package batch_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/tracing"
)

// With tracing on, the events a sweep chunk and a quarantine retry write
// carry the traceparent of a span of that transaction, as a scan chunk's
// do, so the publisher and the indexer continue their trace. Not parallel:
// the tracer is process-wide.
func TestSweepAndQuarantineRetryEventsCarryATraceParent(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tracing.Use(sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp)))
	t.Cleanup(func() { tracing.Use(nil) })
	ctx := context.Background()
	_, pool := newDB(t)
	seed(t, pool, 1, 10, 1, 1) // ids 7..70, tenant t0
	_, err := pool.Exec(ctx, `UPDATE source_records SET payload = '[1,2]' WHERE id = 21`)
	require.NoError(t, err)
	s := vanishedSpec(func(s *batch.Spec) { s.Errors.Policy = batch.PolicyQuarantine })
	_, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)

	_, err = pool.Exec(ctx, `DELETE FROM source_records WHERE id = 14`)
	require.NoError(t, err)
	_, err = run(t, pool, s, batch.Config{}) // the sweep writes the delete of 14
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE source_records SET payload = '{"title":"fixed"}' WHERE id = 21`)
	require.NoError(t, err)
	res, err := batch.RetryQuarantine(ctx, pool, s, nil, batch.RetryOptions{})
	require.NoError(t, err)
	require.Zero(t, res.StillBad)

	spanOf := func(query string) string {
		t.Helper()
		var tp *string
		require.NoError(t, pool.QueryRow(ctx, query).Scan(&tp))
		require.NotNil(t, tp, "no traceparent: %s", query)
		sc, ok := tracing.Parse(*tp)
		require.True(t, ok, *tp)
		for _, s := range exp.GetSpans() {
			if s.SpanContext.SpanID() == sc.SpanID() && s.SpanContext.TraceID() == sc.TraceID() {
				return s.Name
			}
		}
		return ""
	}
	require.Equal(t, "batch.sweep_chunk", spanOf(`SELECT headers->>'traceparent' FROM outbox_event_members WHERE aggregate_id = '14' AND event_type = 'delete'`))
	require.Equal(t, "batch.quarantine_retry", spanOf(`SELECT headers->>'traceparent' FROM outbox_event_members WHERE aggregate_id = '21'`))
}
