package outbox_test

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// slowAcks delays the broker's answers: once on, the first read after each
// write (the start of a response) waits delay, or until the read deadline,
// as a broker that is slow to acknowledge (a loaded broker, acks=all
// waiting on a lagging follower) looks from the client.
type slowAcks struct {
	on    atomic.Bool
	delay time.Duration
}

func (s *slowAcks) dial(ctx context.Context, network, address string) (net.Conn, error) {
	c, err := (&net.Dialer{Timeout: 5 * time.Second}).DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	return &slowConn{Conn: c, s: s}, nil
}

type slowConn struct {
	net.Conn
	s     *slowAcks
	mu    sync.Mutex
	rd    time.Time
	wrote bool
}

func (c *slowConn) SetDeadline(t time.Time) error {
	c.mu.Lock()
	c.rd = t
	c.mu.Unlock()
	return c.Conn.SetDeadline(t)
}

func (c *slowConn) SetReadDeadline(t time.Time) error {
	c.mu.Lock()
	c.rd = t
	c.mu.Unlock()
	return c.Conn.SetReadDeadline(t)
}

func (c *slowConn) Write(b []byte) (int, error) {
	c.mu.Lock()
	c.wrote = true
	c.mu.Unlock()
	return c.Conn.Write(b)
}

func (c *slowConn) Read(b []byte) (int, error) {
	c.mu.Lock()
	rd, wrote := c.rd, c.wrote
	c.wrote = false
	c.mu.Unlock()
	if wrote && c.s.on.Load() {
		wait := c.s.delay
		if !rd.IsZero() && time.Until(rd) < wait {
			time.Sleep(max(0, time.Until(rd)))
			return 0, os.ErrDeadlineExceeded
		}
		time.Sleep(wait)
	}
	return c.Conn.Read(b)
}

// A broker that acknowledges later than the lease deadline allows for
// writing is waited for: the records were written in time, so waiting for
// their acknowledgement sends nothing late, while giving up on it sends
// them again (the broker appends both) and gives up again, for as long as
// the broker is slow. Each event reaches the topic once and the outbox
// drains.
func TestSlowAcknowledgementIsWaitedFor(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	brokers := stack.KafkaBrokers(t)
	pool := stack.Pool(t, stack.Database(t))
	topic := createTopic(t, brokers, 1)
	// A 2s lease: every attempt must finish writing within 1.8 s of the
	// heartbeat before it; the broker answers 2.5 s after each request.
	slow := &slowAcks{delay: 2500 * time.Millisecond}
	cfg := outbox.Config{Brokers: brokers, LeaseTTL: 2 * time.Second, PollInterval: 200 * time.Millisecond,
		WriteTimeout: 10 * time.Second, RetryMaxElapsed: time.Minute, Dial: slow.dial}
	_, stop := runPublisher(t, pool, cfg)
	defer stop()
	event := func(v int64) outbox.Event {
		return outbox.Event{ID: outbox.EventID("ack", "key", v, "v1"), Topic: topic, AggregateID: "key",
			AggregateVersion: v, Payload: json.RawMessage(`{"v":` + strconv.FormatInt(v, 10) + `}`)}
	}
	_, err := outbox.Enqueue(ctx, pool, event(1))
	require.NoError(t, err)
	waitFor(t, time.Minute, "the first event to be published", func() bool { return outboxCount(t, pool) == 0 })

	slow.on.Store(true)
	const events = 20
	for v := int64(2); v <= events; v++ {
		_, err := outbox.Enqueue(ctx, pool, event(v))
		require.NoError(t, err)
	}
	start := time.Now()
	waitFor(t, 30*time.Second, "the outbox to drain through the slow broker", func() bool { return outboxCount(t, pool) == 0 })
	t.Logf("drained %d events through the slow broker in %s", events-1, time.Since(start).Round(time.Millisecond))
	slow.on.Store(false)
	stop()

	msgs := readPartition(t, brokers, topic, 0)
	require.Len(t, distinctIDs(msgs), events, "every event reached the topic")
	require.Len(t, msgs, events, "records on the topic: each event once")
	checkOrder(t, msgs)
}
