package bench_debezium

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// TestDebeziumPeerRoutesOutboxRows checks the harness the benchmark times
// does the work the publisher does, on the same rows: each committed
// outbox row reaches the topic named by its aggregate type, keyed by its
// aggregate id, with its payload as the value byte for byte and its event
// id in a header; events of one key arrive in commit order; deletes from
// the outbox (what the publisher does after sending) send nothing; rows
// committed before `setup` are not sent, rows committed after it are sent
// even while the harness is not running; SIGTERM stops it with exit 0.
func TestDebeziumPeerRoutesOutboxRows(t *testing.T) {
	brokers := stack.KafkaBrokers(t)
	buildDebezium(t)
	srv := newServer(t)
	dbURL, _ := srv.database(t)
	pool := stack.Pool(t, dbURL)
	topic, _ := createTopic(t, brokers)
	ctx := context.Background()

	insertEvents(t, pool, topic, []string{"before-setup"}, 1)
	dbz := debeziumPeer("debezium", brokers)
	dbz.prepare(t, dbURL)
	// Committed while no harness runs: the slot keeps them.
	for v := int64(1); v <= 3; v++ {
		insertEvents(t, pool, topic, []string{"k-ordered"}, v)
	}
	c := newConsumer(t, brokers, topic, true)
	p := dbz.start(t, dbURL)
	waitReady(t, pool, c, topic, p, dbz.name)
	for v := int64(4); v <= 6; v++ {
		insertEvents(t, pool, topic, []string{"k-ordered"}, v)
	}
	_, err := pool.Exec(ctx, `DELETE FROM outbox_events WHERE aggregate_id = 'k-ordered' AND aggregate_version <= 3`)
	require.NoError(t, err)
	insertEvents(t, pool, topic, []string{"last"}, 1)

	type row struct{ eventID, payload string }
	want := map[string][]row{}
	rows, err := pool.Query(ctx, `SELECT aggregate_id, event_id::text, payload::text FROM outbox_events
		WHERE aggregate_id IN ('k-ordered', 'last') ORDER BY id`)
	require.NoError(t, err)
	for rows.Next() {
		var key string
		var r row
		require.NoError(t, rows.Scan(&key, &r.eventID, &r.payload))
		want[key] = append(want[key], r)
	}
	require.NoError(t, rows.Err())
	require.Len(t, want["k-ordered"], 3, "rows 4..6 are still in the outbox")

	require.Eventually(t, func() bool {
		_, ok := c.arrived("last")
		return ok
	}, 2*time.Minute, 50*time.Millisecond, "the last row never reached %s", topic)
	cpu := stop(t, "debezium", p)
	require.Equal(t, 0, p.ExitCode(), "exit code after SIGTERM; stderr:\n%s", tail(p.Stderr(), 30))
	require.Contains(t, p.Stdout(), "stopped sent=")
	t.Logf("harness used %s of CPU", cpu)

	// Order holds per key only: "last" may sit on another partition and
	// arrive between k-ordered's records.
	var got, last []arrival
	var others []string
	for _, a := range c.kept() {
		switch {
		case a.key == "k-ordered":
			got = append(got, a)
		case a.key == "last":
			last = append(last, a)
		case !strings.HasPrefix(a.key, "probe-"):
			others = append(others, a.key)
		}
	}
	// The row from before setup is not sent; versions 1..3 (written while
	// the harness was down) are, before 4..6, and the delete sends nothing.
	require.Empty(t, others, "records of other keys")
	require.Len(t, got, 6, "records of k-ordered")
	require.Len(t, last, 1, "records of last")
	for i, a := range got {
		require.Equal(t, fmt.Sprint(i+1), a.headers["aggregate_version"], "record %d of k-ordered", i)
		require.Equal(t, "upsert", a.headers["event_type"])
		require.Equal(t, topic, a.headers["aggregate_type"])
	}
	for i, r := range want["k-ordered"] {
		a := got[3+i]
		require.Equal(t, r.eventID, a.headers["id"], "event id header of version %d", 4+i)
		require.Equal(t, r.payload, string(a.value), "value of version %d", 4+i)
	}
	require.Equal(t, want["last"][0].eventID, last[0].headers["id"])
	require.Equal(t, want["last"][0].payload, string(last[0].value))
}
