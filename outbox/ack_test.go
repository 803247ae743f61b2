package outbox_test

import (
	"bytes"
	"context"
	"encoding/binary"
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
	c, err := dialDeadlineConn(ctx, network, address)
	if err != nil {
		return nil, err
	}
	return &slowConn{deadlineConn: c, s: s}, nil
}

type slowConn struct {
	*deadlineConn
	s     *slowAcks
	wrote atomic.Bool // a request went out since the last read
}

func (c *slowConn) Write(b []byte) (int, error) {
	c.wrote.Store(true)
	return c.Conn.Write(b)
}

func (c *slowConn) Read(b []byte) (int, error) {
	rd, _ := c.deadlines()
	if c.wrote.Swap(false) && c.s.on.Load() {
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
	// A 4s lease: an attempt may write for at most 3.6 s after the
	// heartbeat before it, and the broker answers 4 s after each request.
	// (A shorter lease would do, but a heartbeat late by more than a third
	// of it on a loaded machine loses the shard, and the records sent again
	// then would fail the count below for another reason.)
	slow := &slowAcks{delay: 4 * time.Second}
	cfg := outbox.Config{Brokers: brokers, LeaseTTL: 4 * time.Second, PollInterval: 200 * time.Millisecond,
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
	waitFor(t, time.Minute, "the outbox to drain through the slow broker", func() bool { return outboxCount(t, pool) == 0 })
	t.Logf("drained %d events through the slow broker in %s", events-1, time.Since(start).Round(time.Millisecond))
	slow.on.Store(false)
	stop()

	msgs := readPartition(t, brokers, topic, 0)
	require.Len(t, distinctIDs(msgs), events, "every event reached the topic")
	require.Len(t, msgs, events, "records on the topic: each event once")
	checkOrder(t, msgs)
}

// wire records the bytes the publisher writes to the broker, per connection.
type wire struct {
	mu    sync.Mutex
	conns []*bytes.Buffer
}

func (w *wire) dial(ctx context.Context, network, address string) (net.Conn, error) {
	c, err := (&net.Dialer{Timeout: 5 * time.Second}).DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	buf := &bytes.Buffer{}
	w.mu.Lock()
	w.conns = append(w.conns, buf)
	w.mu.Unlock()
	return &wireConn{Conn: c, w: w, buf: buf}, nil
}

type wireConn struct {
	net.Conn
	w   *wire
	buf *bytes.Buffer
}

func (c *wireConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.w.mu.Lock()
	c.buf.Write(b[:n])
	c.w.mu.Unlock()
	return n, err
}

// produceTimeouts parses the Produce requests (api key 0, versions 3-8) in
// the bytes written on every connection so far and returns their timeouts.
func (w *wire) produceTimeouts(t *testing.T) []time.Duration {
	t.Helper()
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []time.Duration
	for _, buf := range w.conns {
		b := buf.Bytes()
		for len(b) >= 4 {
			size := int(binary.BigEndian.Uint32(b))
			if len(b) < 4+size {
				break
			}
			req := b[4 : 4+size]
			b = b[4+size:]
			if binary.BigEndian.Uint16(req) != 0 { // not Produce
				continue
			}
			version := binary.BigEndian.Uint16(req[2:])
			require.Truef(t, version >= 3 && version <= 8, "produce v%d: this parser reads v3-v8", version)
			p := req[8:]                                           // past key, version, correlation id
			p = p[2+int(binary.BigEndian.Uint16(p)):]              // client id
			if txn := int16(binary.BigEndian.Uint16(p)); txn > 0 { // transactional id
				p = p[txn:]
			}
			p = p[2+2:] // the transactional id's length, acks
			out = append(out, time.Duration(binary.BigEndian.Uint32(p))*time.Millisecond)
		}
	}
	return out
}

// The produce timeout the broker is given (how long acks=all may wait for
// the in-sync replicas before it answers REQUEST_TIMED_OUT) is a share of
// the attempt's time, not kafka-go's 500 ms default: a broker whose
// followers lag by more than that would otherwise fail requests whose
// records its log already holds, and the retries would write them again.
func TestProduceTimeoutIsTheAttempts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	brokers := stack.KafkaBrokers(t)
	pool := stack.Pool(t, stack.Database(t))
	topic := createTopic(t, brokers, 1)
	w := &wire{}
	cfg := outbox.Config{Brokers: brokers, PollInterval: 200 * time.Millisecond, Dial: w.dial} // default lease and WriteTimeout
	_, stop := runPublisher(t, pool, cfg)
	defer stop()
	for v := int64(1); v <= 3; v++ {
		_, err := outbox.Enqueue(ctx, pool, outbox.Event{ID: outbox.EventID("timeout", "key", v, "v1"), Topic: topic, AggregateID: "key",
			AggregateVersion: v, Payload: json.RawMessage(`{}`)})
		require.NoError(t, err)
	}
	waitFor(t, time.Minute, "the events to be published", func() bool { return outboxCount(t, pool) == 0 })
	stop()
	timeouts := w.produceTimeouts(t)
	require.NotEmpty(t, timeouts, "produce requests on the wire")
	for _, d := range timeouts {
		// The attempt has at least WriteTimeout left for its answer, of
		// which kafka-go gives the broker half.
		require.GreaterOrEqualf(t, d, outbox.DefaultWriteTimeout/2-time.Second, "produce timeouts sent: %v", timeouts)
	}
	t.Logf("produce timeouts sent: %v", timeouts)
}
