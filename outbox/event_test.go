package outbox_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

func TestEventIDMatchesSQL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	for _, tc := range []struct {
		name, source, id, pv string
		version              int64
	}{
		{"plain", "source_records", "42", "v1", 7},
		{"unicode", "주문", "a:b\x1fc", "2026-11", 1},
	} {
		var fromSQL string
		require.NoError(t, pool.QueryRow(ctx, `SELECT outboxrelay_event_id($1, $2, $3, $4)::text`, tc.source, tc.id, tc.version, tc.pv).Scan(&fromSQL), tc.name)
		require.Equal(t, fromSQL, outbox.EventID(tc.source, tc.id, tc.version, tc.pv), tc.name)
	}
	require.NotEqual(t, outbox.EventID("s", "1", 1, "v1"), outbox.EventID("s", "1", 2, "v1"))
}

func TestEnqueueIsIdempotentAndTransactional(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	ev := outbox.Event{
		ID: outbox.EventID("orders", "42", 3, "v1"), Topic: "orders", AggregateType: "order",
		AggregateID: "42", AggregateVersion: 3, Payload: json.RawMessage(`{"status":"cancelled"}`),
		Headers: map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
	}
	del := outbox.Event{ID: outbox.EventID("orders", "43", 9, "v1"), Topic: "orders", AggregateID: "43", AggregateVersion: 9, Type: outbox.TypeDelete}

	// Rolled back with the caller's transaction.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	n, err := outbox.Enqueue(ctx, tx, ev, del)
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	require.NoError(t, tx.Rollback(ctx))
	var count int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_events`).Scan(&count))
	require.Zero(t, count)

	n, err = outbox.Enqueue(ctx, pool, ev, del)
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	n, err = outbox.Enqueue(ctx, pool, ev)
	require.NoError(t, err)
	require.EqualValues(t, 0, n, "same event id twice is a no-op")

	var typ, tp string
	var payload *string
	var shard int
	require.NoError(t, pool.QueryRow(ctx, `SELECT event_type, payload::text, headers->>'traceparent', shard FROM outbox_events WHERE aggregate_id = '42'`).Scan(&typ, &payload, &tp, &shard))
	require.Equal(t, outbox.TypeUpsert, typ)
	require.JSONEq(t, `{"status":"cancelled"}`, *payload)
	require.Equal(t, ev.Headers["traceparent"], tp)
	require.True(t, shard >= 0 && shard < 64)
	require.NoError(t, pool.QueryRow(ctx, `SELECT event_type, payload::text FROM outbox_events WHERE aggregate_id = '43'`).Scan(&typ, &payload))
	require.Equal(t, outbox.TypeDelete, typ)
	require.Nil(t, payload)

	_, err = outbox.Enqueue(ctx, pool, outbox.Event{ID: ev.ID, Topic: "t", AggregateID: "1"})
	require.ErrorIs(t, err, outbox.ErrInvalidEvent)

	// An upsert's payload is the document, a JSON object: anything else is
	// refused before the database's constraint would (migration 018),
	// with ErrInvalidEvent; an application type carries any JSON.
	for _, payload := range []string{`[1,2]`, `"text"`, `null`, ``} {
		e := outbox.Event{ID: outbox.EventID("t", "50", 1, "v1"), Topic: "t", AggregateID: "50", AggregateVersion: 1}
		if payload != "" {
			e.Payload = json.RawMessage(payload)
		}
		_, err = outbox.Enqueue(ctx, pool, e)
		require.ErrorIs(t, err, outbox.ErrInvalidEvent, "payload %q", payload)
	}
	_, err = outbox.Enqueue(ctx, pool, outbox.Event{ID: outbox.EventID("t", "51", 1, "v1"), Topic: "t", AggregateID: "51", AggregateVersion: 1,
		Type: "order.shipped", Payload: json.RawMessage(`[1,2]`)})
	require.NoError(t, err)
}
