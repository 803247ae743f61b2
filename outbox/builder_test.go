package outbox_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// InsertEventsSQL writes events from a query the way Enqueue writes them:
// the same event as Enqueue's is a no-op, and the columns land where the
// publisher reads them.
func TestInsertEventsSQLWritesLikeEnqueue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	n, err := outbox.Enqueue(ctx, pool, outbox.Event{ID: outbox.EventID("src", "1", 1, "v1"), Topic: "t", AggregateType: "rec", AggregateID: "1", AggregateVersion: 1, Payload: json.RawMessage(`{}`)})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)

	sql := outbox.InsertEventsSQL(outbox.EventSelect{
		EventID:          `outboxrelay_event_id('src', id, ver, 'v1')`,
		Topic:            `$1::text`,
		AggregateType:    `'rec'`,
		AggregateID:      "id",
		AggregateVersion: "ver",
		EventType:        `CASE WHEN del THEN 'delete' ELSE 'upsert' END`,
		Payload:          `CASE WHEN del THEN NULL ELSE json_build_object('id', id) END`,
		Headers:          `jsonb_build_object('ce_processorversion', 'v1')`,
	}, `(VALUES ('1', 1::bigint, false), ('2', 1::bigint, false), ('3', 4::bigint, true)) AS r(id, ver, del)`)
	tag, err := pool.Exec(ctx, sql, "t")
	require.NoError(t, err)
	require.EqualValues(t, 2, tag.RowsAffected(), "event 1 was already enqueued")

	var typ, pv string
	var ver int64
	var payload *string
	require.NoError(t, pool.QueryRow(ctx, `SELECT event_type, aggregate_version, payload::text, headers->>'ce_processorversion' FROM outbox_events WHERE aggregate_id = '3'`).Scan(&typ, &ver, &payload, &pv))
	require.Equal(t, outbox.TypeDelete, typ)
	require.EqualValues(t, 4, ver)
	require.Nil(t, payload)
	require.Equal(t, "v1", pv)
	var id string
	require.NoError(t, pool.QueryRow(ctx, `SELECT event_id::text FROM outbox_events WHERE aggregate_id = '2'`).Scan(&id))
	require.Equal(t, outbox.EventID("src", "2", 1, "v1"), id)
}
