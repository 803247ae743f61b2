package outbox_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// createTopic makes a topic with several partitions so per-key order is
// tested across partitions.
func createTopic(t *testing.T, brokers []string, partitions int) string {
	t.Helper()
	topic := stack.UniqueName("outbox-test")
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 30 * time.Second}
	resp, err := client.CreateTopics(context.Background(), &kafka.CreateTopicsRequest{
		Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: partitions, ReplicationFactor: 1}},
	})
	require.NoError(t, err)
	require.NoError(t, resp.Errors[topic])
	return topic
}

// insertEvents enqueues events g in [from, to) server-side: key "k<g%keys>",
// version g/keys+1, so one key's versions grow with the id.
func insertEvents(t *testing.T, pool *pgxpool.Pool, topic string, keys, from, to, pad int) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `
INSERT INTO outbox_events (event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload)
SELECT outboxrelay_event_id('test', 'k' || (g % $2), g / $2 + 1, 'v1'), $1, 'test', 'k' || (g % $2), g / $2 + 1, 'upsert',
       jsonb_build_object('g', g, 'pad', repeat('x', $5))
FROM generate_series($3::int, $4::int - 1) AS g`, topic, keys, from, to, pad)
	require.NoError(t, err)
}

func wantIDs(topic string, keys, from, to int) map[string]bool {
	_ = topic
	out := make(map[string]bool, to-from)
	for g := from; g < to; g++ {
		out[outbox.EventID("test", "k"+strconv.Itoa(g%keys), int64(g/keys+1), "v1")] = true
	}
	return out
}

type consumed struct {
	key, eventID string
	version      int64
	partition    int
	headers      map[string]string
	value        []byte
}

// consumeAll reads every partition of topic from the start until every id in
// want was seen (or the deadline passes) and returns the messages in
// partition order.
func consumeAll(t *testing.T, brokers []string, topic string, want map[string]bool, timeout time.Duration) []consumed {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	conn, err := kafka.DialContext(ctx, "tcp", brokers[0])
	require.NoError(t, err)
	parts, err := conn.ReadPartitions(topic)
	conn.Close()
	require.NoError(t, err)

	var mu sync.Mutex
	seen := map[string]bool{}
	missing := len(want)
	byPart := make([][]consumed, len(parts))
	allSeen := make(chan struct{})
	var wg sync.WaitGroup
	for _, p := range parts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := kafka.NewReader(kafka.ReaderConfig{
				Brokers: brokers, Topic: topic, Partition: p.ID, MinBytes: 1, MaxBytes: 8 << 20, MaxWait: 100 * time.Millisecond,
				Dialer: &kafka.Dialer{Timeout: 5 * time.Second, Resolver: &net.Resolver{}},
			})
			defer r.Close()
			_ = r.SetOffset(kafka.FirstOffset)
			for {
				m, err := r.ReadMessage(ctx)
				if err != nil {
					return
				}
				c := consumed{key: string(m.Key), partition: p.ID, headers: map[string]string{}, value: m.Value}
				for _, h := range m.Headers {
					c.headers[h.Key] = string(h.Value)
				}
				c.eventID = c.headers[outbox.HeaderID]
				c.version, _ = strconv.ParseInt(c.headers[outbox.HeaderAggregateVersion], 10, 64)
				mu.Lock()
				byPart[p.ID] = append(byPart[p.ID], c)
				if want[c.eventID] && !seen[c.eventID] {
					seen[c.eventID] = true
					missing--
					if missing == 0 {
						close(allSeen)
					}
				}
				mu.Unlock()
			}
		}()
	}
	select {
	case <-allSeen:
	case <-ctx.Done():
	}
	cancel()
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	require.Zerof(t, missing, "%d of %d events never reached topic %s", missing, len(want), topic)
	var out []consumed
	for _, msgs := range byPart {
		out = append(out, msgs...)
	}
	return out
}

// checkOrder verifies per-key order the way a consumer needs it: a message
// may repeat an event already seen (at-least-once), but a new event never
// arrives after a newer version of its key. It returns the duplicates.
func checkOrder(t *testing.T, msgs []consumed) (duplicates int) {
	t.Helper()
	type keyState struct {
		max       int64
		partition int
		seen      map[string]bool
	}
	keys := map[string]*keyState{}
	for _, m := range msgs {
		k := keys[m.key]
		if k == nil {
			k = &keyState{partition: m.partition, seen: map[string]bool{}}
			keys[m.key] = k
		}
		require.Equalf(t, k.partition, m.partition, "key %s in two partitions", m.key)
		if k.seen[m.eventID] {
			duplicates++
			continue
		}
		require.GreaterOrEqualf(t, m.version, k.max, "key %s: new event %s version %d arrived after version %d", m.key, m.eventID, m.version, k.max)
		k.seen[m.eventID] = true
		k.max = m.version
	}
	return duplicates
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond) // polling a condition, not synchronising
	}
}

func outboxCount(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	var n int64
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_events`).Scan(&n))
	return n
}

// startPublisher runs an in-process publisher until the test ends.
func startPublisher(t *testing.T, pool *pgxpool.Pool, cfg outbox.Config) *outbox.Publisher {
	t.Helper()
	if cfg.LeaseTTL == 0 {
		cfg.LeaseTTL = 2 * time.Second
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 200 * time.Millisecond
	}
	if cfg.Logger == nil {
		cfg.Logger = testLogger()
	}
	pub, err := outbox.NewPublisher(pool, cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- pub.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(time.Minute):
			t.Errorf("publisher %s did not stop", pub.ID())
		}
	})
	return pub
}

func testLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

func fmtDup(n, total int) string { return fmt.Sprintf("%d duplicates in %d messages", n, total) }

// deadlineConn is a connection to the broker that remembers the deadlines
// kafka-go sets on it, for the fault-injecting connections (slowConn,
// gatedConn) that act on them.
type deadlineConn struct {
	net.Conn
	mu     sync.Mutex
	rd, wd time.Time
}

// dialDeadlineConn dials address as the publisher's default dialer does.
func dialDeadlineConn(ctx context.Context, network, address string) (*deadlineConn, error) {
	c, err := (&net.Dialer{Timeout: 5 * time.Second}).DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	return &deadlineConn{Conn: c}, nil
}

func (c *deadlineConn) SetDeadline(t time.Time) error {
	c.mu.Lock()
	c.rd, c.wd = t, t
	c.mu.Unlock()
	return c.Conn.SetDeadline(t)
}

func (c *deadlineConn) SetReadDeadline(t time.Time) error {
	c.mu.Lock()
	c.rd = t
	c.mu.Unlock()
	return c.Conn.SetReadDeadline(t)
}

func (c *deadlineConn) SetWriteDeadline(t time.Time) error {
	c.mu.Lock()
	c.wd = t
	c.mu.Unlock()
	return c.Conn.SetWriteDeadline(t)
}

// deadlines are the read and write deadlines last set.
func (c *deadlineConn) deadlines() (rd, wd time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.rd, c.wd
}
