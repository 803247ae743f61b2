package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// publisher status shows the backlog and dead letters the database holds;
// dead-letter list shows them and dead-letter retry moves them back into
// the outbox.
func TestPublisherStatusAndDeadLetterCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := stack.Database(t)
	pool := stack.Pool(t, url)
	bin := testproc.Build(t, "publisher")
	env := []string{"DATABASE_URL=" + url}

	var events []outbox.Event
	for i := range 5 {
		id := fmt.Sprint(i)
		events = append(events, outbox.Event{ID: outbox.EventID("cli", id, 1, "v1"), Topic: "cli", AggregateType: "t", AggregateID: id, AggregateVersion: 1, Payload: json.RawMessage(`{}`)})
	}
	_, err := outbox.Enqueue(ctx, pool, events...)
	require.NoError(t, err)
	// A dead letter as the publisher writes it when the broker refuses an event.
	_, err = pool.Exec(ctx, `INSERT INTO outbox_dead_letters (outbox_id, event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, shard, created_at, error, error_code)
VALUES (999, $1, 'cli', 't', 'big', 3, 'upsert', '{"x":1}', '{}', outboxrelay_shard('big'), now(), 'message too large', 10)`, outbox.EventID("cli", "big", 3, "v1"))
	require.NoError(t, err)

	status := testproc.Run(t, time.Minute, bin, env, "status")
	require.Equal(t, 0, status.ExitCode(), status.Stderr())
	require.Contains(t, status.Stdout(), "backlog: 5 event(s)", status.Stdout())
	require.Contains(t, status.Stdout(), "dead letters: 1", status.Stdout())

	list := testproc.Run(t, time.Minute, bin, env, "dead-letter", "list")
	require.Equal(t, 0, list.ExitCode(), list.Stderr())
	require.Contains(t, list.Stdout(), "big")
	require.Contains(t, list.Stdout(), "message too large")

	bad := testproc.Run(t, time.Minute, bin, env, "dead-letter", "retry")
	require.Equal(t, 2, bad.ExitCode(), "retry without --ids or --all is a usage error: %s", bad.Stderr())

	retry := testproc.Run(t, time.Minute, bin, env, "dead-letter", "retry", "--all")
	require.Equal(t, 0, retry.ExitCode(), retry.Stderr())
	var deadLetters, queued int
	require.NoError(t, pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox_dead_letters), (SELECT count(*) FROM outbox_event_members WHERE aggregate_id = 'big' AND aggregate_version = 3)`).Scan(&deadLetters, &queued))
	require.Zero(t, deadLetters)
	require.Equal(t, 1, queued, "the dead letter is back in the outbox")
}
