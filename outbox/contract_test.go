package outbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// An application that writes outbox_events with its own SQL (any
// language, docs/producing-events.md) gets a row the publisher and the
// indexer can use, or an error from the database at insert time, naming
// the constraint. Without the constraints each of these rows was accepted
// and failed only later: dead-lettered by the publisher (headers) or by
// the indexer (missing_key, bad_version, missing_document, invalid_json).
func TestOutboxEventsRefuseMalformedInserts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := stack.Database(t)

	insert := func(topic, aggID string, version int64, typ string, payload, headers *string) error {
		conn, err := pgx.Connect(ctx, url) // a connection of its own, as an application has
		require.NoError(t, err)
		defer conn.Close(ctx)
		h := "{}"
		if headers != nil {
			h = *headers
		}
		_, err = conn.Exec(ctx, `
INSERT INTO outbox_events (event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers)
VALUES (gen_random_uuid(), $1, 'product', $2, $3, $4, $5::json, $6::jsonb)`, topic, aggID, version, typ, payload, h)
		return err
	}
	str := func(s string) *string { return &s }
	doc := str(`{"name":"lamp"}`)

	// Valid rows: an upsert with a document, a delete without one, an
	// application's own event type with any payload, headers of strings.
	require.NoError(t, insert("products", "p1", 1, "upsert", doc, nil))
	require.NoError(t, insert("products", "p1", 2, "delete", nil, nil))
	require.NoError(t, insert("products", "p1", 0, "upsert", doc, str(`{"traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}`)))
	require.NoError(t, insert("audit", "p1", 3, "price_changed", str(`[1,2]`), nil))
	require.NoError(t, insert("audit", "p1", 4, "price_checked", nil, nil))

	for _, tc := range []struct {
		name       string
		topic, id  string
		version    int64
		typ        string
		payload    *string
		headers    *string
		constraint string
	}{
		{"empty topic", "", "p1", 1, "upsert", doc, nil, "outbox_events_topic_required"},
		{"empty aggregate id", "products", "", 1, "upsert", doc, nil, "outbox_events_aggregate_id_required"},
		{"negative version", "products", "p1", -1, "upsert", doc, nil, "outbox_events_aggregate_version_not_negative"},
		{"upsert without a document", "products", "p1", 1, "upsert", nil, nil, "outbox_events_upsert_document"},
		{"upsert with JSON null", "products", "p1", 1, "upsert", str(`null`), nil, "outbox_events_upsert_document"},
		{"upsert with an array", "products", "p1", 1, "upsert", str(`[{"name":"lamp"}]`), nil, "outbox_events_upsert_document"},
		{"headers an array", "products", "p1", 1, "upsert", doc, str(`["traceparent"]`), "outbox_events_headers_strings"},
		{"a header not a string", "products", "p1", 1, "upsert", doc, str(`{"retries":3}`), "outbox_events_headers_strings"},
		{"a header an array of strings", "products", "p1", 1, "upsert", doc, str(`{"tags":["a"]}`), "outbox_events_headers_strings"},
		{"a header an empty array", "products", "p1", 1, "upsert", doc, str(`{"tags":[]}`), "outbox_events_headers_strings"},
	} {
		err := insert(tc.topic, tc.id, tc.version, tc.typ, tc.payload, tc.headers)
		var pgErr *pgconn.PgError
		require.Truef(t, errors.As(err, &pgErr), "%s: want a check violation, got %v", tc.name, err)
		require.Equal(t, "23514", pgErr.Code, "%s: %s", tc.name, pgErr.Message) // check_violation
		require.Equal(t, tc.constraint, pgErr.ConstraintName, tc.name)
		require.Contains(t, pgErr.Message, `violates check constraint "`+tc.constraint+`"`, tc.name)
	}

	var n int
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM outbox_events`).Scan(&n))
	require.Equal(t, 5, n, "the valid rows only")
}
