package outbox_test

import (
	"context"
	"encoding/json"
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

// runPublisher runs a publisher until the returned stop is called (or the
// test ends); stop returns once Run has returned, that is once every shard
// worker of the publisher has finished.
func runPublisher(t *testing.T, pool *pgxpool.Pool, cfg outbox.Config) (pub *outbox.Publisher, stop func()) {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testLogger()
	}
	pub, err := outbox.NewPublisher(pool, cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- pub.Run(ctx) }()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(time.Minute):
			t.Errorf("publisher %s did not stop", pub.ID())
		}
	}
	t.Cleanup(stop)
	return pub, stop
}

// keyInShard returns a key whose shard satisfies ok.
func keyInShard(t *testing.T, pool *pgxpool.Pool, prefix string, ok func(shard int) bool) (string, int) {
	t.Helper()
	for i := range 10_000 {
		key := prefix + strconv.Itoa(i)
		var shard int
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT outboxrelay_shard($1)`, key).Scan(&shard))
		if ok(shard) {
			return key, shard
		}
	}
	t.Fatalf("no key with prefix %s in the wanted shards", prefix)
	return "", 0
}

// gate stands for the network between one publisher and the broker: while
// closed, what the publisher writes does not get through, and a write
// blocks until the gate opens or the socket's write deadline passes (a
// stalled TCP connection with a full send buffer). Reads are not held.
type gate struct {
	mu     sync.Mutex
	closed bool
	open   chan struct{} // closed when the gate opens
}

func newGate() *gate { return &gate{open: make(chan struct{})} }

func (g *gate) shut() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.closed {
		g.closed, g.open = true, make(chan struct{})
	}
}

func (g *gate) release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		g.closed = false
		close(g.open)
	}
}

// wait blocks while the gate is closed, until deadline (zero: none).
func (g *gate) wait(deadline time.Time) error {
	g.mu.Lock()
	closed, open := g.closed, g.open
	g.mu.Unlock()
	if !closed {
		return nil
	}
	var timeout <-chan time.Time
	if !deadline.IsZero() {
		timer := time.NewTimer(time.Until(deadline))
		defer timer.Stop()
		timeout = timer.C
	}
	select {
	case <-open:
		return nil
	case <-timeout:
		return os.ErrDeadlineExceeded
	}
}

func (g *gate) dial(ctx context.Context, network, address string) (net.Conn, error) {
	c, err := dialDeadlineConn(ctx, network, address)
	if err != nil {
		return nil, err
	}
	return &gatedConn{deadlineConn: c, g: g}, nil
}

type gatedConn struct {
	*deadlineConn
	g *gate
}

func (c *gatedConn) Write(b []byte) (int, error) {
	_, wd := c.deadlines()
	if err := c.g.wait(wd); err != nil {
		return 0, err
	}
	return c.Conn.Write(b)
}

// A publisher whose broker stalls mid-write and whose heartbeats stall too
// loses its shard to a second publisher. Nothing it was sending may reach
// the partition after the second publisher took over: the stale write would
// land after the newer publisher's records of the same key (v1, v2, v1).
//
// Publishers A and B share the shards. The broker stalls for A only (its
// connections go through a gate, which holds what A writes), an event is
// written to one of A's shards, and A's heartbeats are blocked behind a row
// lock. A's write cannot get through; its lease runs out; B claims the
// shard, sends the event and a newer version of it. When A's network
// recovers, A must have given up: no record of A follows B's on the
// partition, and per-key order holds. (A paused broker cannot show this:
// it stalls B too, and on SIGCONT it appends what A wrote before B's.)
func TestNoWriteAfterLeaseLost(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	brokers := stack.KafkaBrokers(t)
	pool := stack.Pool(t, stack.Database(t))
	topic := createTopic(t, brokers, 1)
	const ttl = 2 * time.Second
	// Sources tell the two publishers' records apart on the topic.
	cfg := func(source string) outbox.Config {
		return outbox.Config{Brokers: brokers, Source: source, LeaseTTL: ttl, PollInterval: 200 * time.Millisecond,
			WriteTimeout: 10 * time.Second, RetryMaxElapsed: time.Minute}
	}
	event := func(key string, v int64) outbox.Event {
		return outbox.Event{ID: outbox.EventID("lease", key, v, "v1"), Topic: topic, AggregateID: key,
			AggregateVersion: v, Payload: json.RawMessage(`{"v":` + strconv.FormatInt(v, 10) + `}`)}
	}
	owners := func() map[string]int {
		rows, err := pool.Query(ctx, `SELECT owner, count(*) FROM outbox_shard_leases WHERE owner IS NOT NULL GROUP BY owner`)
		require.NoError(t, err)
		defer rows.Close()
		out := map[string]int{}
		for rows.Next() {
			var o string
			var n int
			require.NoError(t, rows.Scan(&o, &n))
			out[o] = n
		}
		require.NoError(t, rows.Err())
		return out
	}
	ownerOf := func(shard int) string {
		var o *string
		require.NoError(t, pool.QueryRow(ctx, `SELECT owner FROM outbox_shard_leases WHERE shard = $1`, shard).Scan(&o))
		if o == nil {
			return ""
		}
		return *o
	}

	netA := newGate()
	cfgA := cfg("pub-a")
	cfgA.Dial = netA.dial
	a, stopA := runPublisher(t, pool, cfgA)
	waitFor(t, time.Minute, "A to hold every shard", func() bool { return owners()[a.ID()] == outbox.NumShards })
	b, stopB := runPublisher(t, pool, cfg("pub-b"))
	waitFor(t, time.Minute, "A and B to hold half of the shards each", func() bool {
		o := owners()
		return o[a.ID()] == outbox.NumShards/2 && o[b.ID()] == outbox.NumShards/2
	})
	keyA, shardA := keyInShard(t, pool, "a", func(s int) bool { return ownerOf(s) == a.ID() })
	keyB, _ := keyInShard(t, pool, "b", func(s int) bool { return ownerOf(s) == b.ID() })
	_, err := outbox.Enqueue(ctx, pool, event(keyB, 1))
	require.NoError(t, err)
	waitFor(t, time.Minute, "B's first event to be published", func() bool { return outboxCount(t, pool) == 0 })

	netA.shut()
	t.Cleanup(netA.release)
	_, err = outbox.Enqueue(ctx, pool, event(keyA, 1))
	require.NoError(t, err)
	// A's heartbeat upserts its outbox_publishers row: holding that row
	// blocks every heartbeat of A, as a database that stops answering A would.
	lock, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer lock.Rollback(ctx)
	_, err = lock.Exec(ctx, `SELECT FROM outbox_publishers WHERE id = $1 FOR UPDATE`, a.ID())
	require.NoError(t, err)
	waitFor(t, time.Minute, "B to take A's shard after A's lease ran out", func() bool { return ownerOf(shardA) == b.ID() })
	_, err = outbox.Enqueue(ctx, pool, event(keyA, 2))
	require.NoError(t, err)

	waitFor(t, time.Minute, "B to publish both versions", func() bool { return outboxCount(t, pool) == 0 })
	netA.release()
	require.NoError(t, lock.Rollback(ctx))
	stopA() // everything A will ever send is sent once its workers finished
	stopB()

	msgs := readPartition(t, brokers, topic, 0)
	require.Len(t, distinctIDs(msgs), 3, "every event reached the topic")
	firstB := -1
	for i, m := range msgs {
		t.Logf("offset %d: key %s version %d from %s", i, m.key, m.version, m.headers[outbox.HeaderSource])
	}
	for i, m := range msgs {
		if m.key == keyA && m.headers[outbox.HeaderSource] == "pub-b" && firstB < 0 {
			firstB = i
		}
	}
	require.GreaterOrEqual(t, firstB, 0, "B published A's shard")
	for i, m := range msgs[firstB:] {
		require.NotEqualf(t, "pub-a", m.headers[outbox.HeaderSource],
			"record %d (key %s version %d) was sent by A after B had taken the shard", firstB+i, m.key, m.version)
	}
	checkOrder(t, msgs)
}

// readPartition reads one partition from its first offset to its end.
func readPartition(t *testing.T, brokers []string, topic string, partition int) []consumed {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := kafka.DialLeader(ctx, "tcp", brokers[0], topic, partition)
	require.NoError(t, err)
	last, err := conn.ReadLastOffset()
	conn.Close()
	require.NoError(t, err)
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: topic, Partition: partition, MaxWait: 100 * time.Millisecond})
	defer r.Close()
	require.NoError(t, r.SetOffset(kafka.FirstOffset))
	var out []consumed
	for int64(len(out)) < last {
		m, err := r.ReadMessage(ctx)
		require.NoError(t, err)
		c := consumed{key: string(m.Key), partition: partition, headers: map[string]string{}, value: m.Value}
		for _, h := range m.Headers {
			c.headers[h.Key] = string(h.Value)
		}
		c.eventID = c.headers[outbox.HeaderID]
		c.version, _ = strconv.ParseInt(c.headers[outbox.HeaderAggregateVersion], 10, 64)
		out = append(out, c)
		if m.Offset+1 >= last {
			break
		}
	}
	return out
}

func distinctIDs(msgs []consumed) map[string]bool {
	out := map[string]bool{}
	for _, m := range msgs {
		out[m.eventID] = true
	}
	return out
}

// A second process started with the PUBLISHER_ID of a running one is
// refused with ErrPublisherIDInUse; the first keeps its shards and goes on
// publishing.
func TestDuplicatePublisherIDRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	brokers := stack.KafkaBrokers(t)
	pool := stack.Pool(t, stack.Database(t))
	topic := createTopic(t, brokers, 2)
	cfg := outbox.Config{Brokers: brokers, ID: "same-id", LeaseTTL: time.Second, PollInterval: 200 * time.Millisecond, Logger: testLogger()}
	first, err := outbox.NewPublisher(pool, cfg)
	require.NoError(t, err)
	firstCtx, stopFirst := context.WithCancel(ctx)
	firstDone := make(chan error, 1)
	go func() { firstDone <- first.Run(firstCtx) }()
	held := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_shard_leases WHERE owner = 'same-id'`).Scan(&n))
		return n
	}
	waitFor(t, time.Minute, "the first publisher to hold every shard", func() bool { return held() == outbox.NumShards })
	var epochs int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT sum(epoch) FROM outbox_shard_leases`).Scan(&epochs))

	second, err := outbox.NewPublisher(pool, cfg)
	require.NoError(t, err)
	secondCtx, stopSecond := context.WithTimeout(ctx, time.Minute)
	defer stopSecond()
	err = second.Run(secondCtx)
	require.ErrorIs(t, err, outbox.ErrPublisherIDInUse)
	require.Contains(t, err.Error(), `PUBLISHER_ID="same-id"`)

	require.Equal(t, outbox.NumShards, held(), "the first publisher keeps its shards")
	var after int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT sum(epoch) FROM outbox_shard_leases`).Scan(&after))
	require.Equal(t, epochs, after, "no shard changed hands")
	insertEvents(t, pool, topic, 10, 0, 100, 10)
	consumeAll(t, brokers, topic, wantIDs(topic, 10, 0, 100), time.Minute)
	waitFor(t, time.Minute, "the first publisher to drain the outbox", func() bool { return outboxCount(t, pool) == 0 })

	stopFirst()
	require.NoError(t, <-firstDone)
	// Once the first has stopped, the id is free again.
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_publishers WHERE id = 'same-id'`).Scan(&n))
	require.Zero(t, n, "a clean stop leaves the membership")
}

// A publisher that stalls past its lease TTL while a second process with
// the same PUBLISHER_ID waits can lose the id to it: the second one's
// heartbeat takes the expired membership and renews the id's leases,
// epochs unchanged, and starts sending. When the first one wakes and stops
// (ErrPublisherIDInUse), the leases are no longer its own: releasing them
// by (id, epoch) freed the live shards of the new holder for a third
// publisher, which then sent from them beside it. The takeover is what the
// second process's heartbeat writes, done here by hand.
func TestPublisherThatLostItsIDKeepsOffTheNewHoldersLeases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	brokers := stack.KafkaBrokers(t)
	pool := stack.Pool(t, stack.Database(t))
	cfg := outbox.Config{Brokers: brokers, ID: "dup", LeaseTTL: time.Second, PollInterval: 200 * time.Millisecond, Logger: testLogger()}
	first, err := outbox.NewPublisher(pool, cfg)
	require.NoError(t, err)
	runCtx, stop := context.WithTimeout(ctx, time.Minute)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- first.Run(runCtx) }()
	leases := func() (n, epochs int64) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), coalesce(sum(epoch), 0) FROM outbox_shard_leases WHERE owner = 'dup'`).Scan(&n, &epochs))
		return n, epochs
	}
	waitFor(t, time.Minute, "the publisher to hold every shard", func() bool { n, _ := leases(); return n == outbox.NumShards })

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `UPDATE outbox_publishers SET instance = 'another-process', heartbeat_at = now(), expires_at = now() + interval '1 hour' WHERE id = 'dup'`)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `UPDATE outbox_shard_leases SET expires_at = now() + interval '1 hour' WHERE owner = 'dup'`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	n, epochs := leases()
	require.EqualValues(t, outbox.NumShards, n)

	require.ErrorIs(t, <-done, outbox.ErrPublisherIDInUse)
	after, afterEpochs := leases()
	require.Equal(t, n, after, "the new holder's leases were released")
	require.Equal(t, epochs, afterEpochs)
}
