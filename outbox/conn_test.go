package outbox_test

import (
	"context"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// A publisher set up as `publisher run` does (a one-connection pool,
// ShardConns lanes) never holds more than ShardConns + 4 connections while
// it drains every shard; with LISTEN off it holds no session of its own and
// works with the query modes PgBouncer's transaction mode needs (no
// statement prepared beyond one transaction), woken by polling alone.
func TestPublisherConnections(t *testing.T) {
	t.Parallel()
	brokers := stack.KafkaBrokers(t)
	for _, tc := range []struct {
		name     string
		mode     string // pgx default_query_exec_mode; "" keeps the default
		noListen bool
		// want is the most connections the publisher may hold.
		want int
	}{
		{name: "default", want: 4 + 4},
		{name: "exec, LISTEN off", mode: "exec", noListen: true, want: 4 + 3},
		{name: "simple protocol, LISTEN off", mode: "simple_protocol", noListen: true, want: 4 + 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			dbURL := stack.Database(t)
			u, err := url.Parse(dbURL)
			require.NoError(t, err)
			q := u.Query()
			app := stack.UniqueName("pubconn")
			q.Set("application_name", app)
			q.Set("pool_max_conns", "1")
			if tc.mode != "" {
				q.Set("default_query_exec_mode", tc.mode)
			}
			u.RawQuery = q.Encode()
			pubPool := stack.Pool(t, u.String())
			pool := stack.Pool(t, dbURL)
			topic := createTopic(t, brokers, 3)
			const keys, events = 500, 5000

			var peak atomic.Int64
			stop := make(chan struct{})
			sampled := make(chan struct{})
			go func() {
				defer close(sampled)
				for {
					var n int64
					if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&n); err == nil && n > peak.Load() {
						peak.Store(n)
					}
					select {
					case <-stop:
						return
					case <-time.After(20 * time.Millisecond): // sampling, not synchronising
					}
				}
			}()
			startPublisher(t, pubPool, outbox.Config{Brokers: brokers, ShardConns: 4, NoListen: tc.noListen,
				PollInterval: 100 * time.Millisecond, BatchSize: 50})
			insertEvents(t, pool, topic, keys, 0, events, 50)
			msgs := consumeAll(t, brokers, topic, wantIDs(topic, keys, 0, events), 2*time.Minute)
			checkOrder(t, msgs)
			waitFor(t, time.Minute, "the outbox to drain", func() bool { return outboxCount(t, pool) == 0 })
			close(stop)
			<-sampled
			require.Positive(t, peak.Load())
			require.LessOrEqual(t, peak.Load(), int64(tc.want), "connections held by the publisher")
			t.Logf("%s: at most %d connections", tc.name, peak.Load())
		})
	}
}
