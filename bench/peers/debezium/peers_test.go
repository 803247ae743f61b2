package bench_debezium

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outboxrelay/outboxrelay/internal/migrate"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

func TestMain(m *testing.M) { stack.Main(m) }

const (
	// debeziumVersion is the one pom.xml builds; it goes into the results.
	debeziumVersion = "3.6.1.Final"
	partitions      = 6
	payloadPad      = 430 // ~500-byte value with the JSON around it, as bench/publisher
	keys            = 10_000
)

// logicalPostgres returns the maintenance URL of a PostgreSQL server with
// wal_level=logical: PEERS_DATABASE_URL when set (bench-peers may share one
// server between its peers), else a private cluster started for this test
// binary. The shared test server runs with wal_level=replica, and changing
// it needs a restart that the other engineers' tests would notice.
func logicalPostgres(tb testing.TB) string {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if u := os.Getenv("PEERS_DATABASE_URL"); u != "" {
		if level := walLevel(tb, ctx, u); level != "logical" {
			tb.Fatalf("PEERS_DATABASE_URL: wal_level is %q, want logical", level)
		}
		return u
	}
	srv := stack.Private(tb, "postgres")
	if level := walLevel(tb, ctx, srv.Env); level == "logical" {
		return srv.Env
	}
	conn, err := pgx.Connect(ctx, srv.Env)
	if err != nil {
		tb.Fatalf("connect to private postgres: %v", err)
	}
	_, err = conn.Exec(ctx, `ALTER SYSTEM SET wal_level = 'logical'`)
	_ = conn.Close(ctx)
	if err != nil {
		tb.Fatalf("set wal_level: %v", err)
	}
	// wal_level takes a restart; the cluster keeps its port and data.
	if err := srv.Stop(); err != nil {
		tb.Fatalf("stop private postgres: %v", err)
	}
	if err := srv.Start(); err != nil {
		tb.Fatalf("restart private postgres: %v", err)
	}
	if level := walLevel(tb, ctx, srv.Env); level != "logical" {
		tb.Fatalf("private postgres: wal_level is %q after the restart, want logical", level)
	}
	return srv.Env
}

func walLevel(tb testing.TB, ctx context.Context, url string) string {
	tb.Helper()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		tb.Fatalf("connect %s: %v", url, err)
	}
	defer conn.Close(ctx)
	var level string
	if err := conn.QueryRow(ctx, `SHOW wal_level`).Scan(&level); err != nil {
		tb.Fatalf("show wal_level: %v", err)
	}
	return level
}

// server is the logical PostgreSQL with a migrated template database, so a
// fresh database per run costs a file copy.
type server struct {
	url  string // maintenance database
	tmpl string
}

func newServer(tb testing.TB) *server {
	tb.Helper()
	s := &server{url: logicalPostgres(tb), tmpl: strings.ReplaceAll(stack.UniqueName("peers_tmpl"), "-", "_")}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s.admin(tb, ctx, fmt.Sprintf("CREATE DATABASE %s", pgx.Identifier{s.tmpl}.Sanitize()))
	pool, err := pgxpool.New(ctx, stack.WithDatabase(s.url, s.tmpl))
	if err != nil {
		tb.Fatalf("open template: %v", err)
	}
	_, err = migrate.Up(ctx, pool, nil)
	pool.Close()
	if err != nil {
		tb.Fatalf("migrate template: %v", err)
	}
	s.admin(tb, ctx, fmt.Sprintf("ALTER DATABASE %s WITH is_template = true", pgx.Identifier{s.tmpl}.Sanitize()))
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		s.admin(tb, ctx, fmt.Sprintf("ALTER DATABASE %s WITH is_template = false", pgx.Identifier{s.tmpl}.Sanitize()))
		s.admin(tb, ctx, fmt.Sprintf("DROP DATABASE IF EXISTS %s WITH (FORCE)", pgx.Identifier{s.tmpl}.Sanitize()))
	})
	return s
}

func (s *server) admin(tb testing.TB, ctx context.Context, sql string, args ...any) {
	tb.Helper()
	conn, err := pgx.Connect(ctx, s.url)
	if err != nil {
		tb.Fatalf("connect %s: %v", s.url, err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, sql, args...); err != nil {
		tb.Fatalf("%s: %v", sql, err)
	}
}

// database creates a fresh migrated database and returns its URL and a
// function that drops it with its replication slots (a database with a
// slot cannot be dropped).
func (s *server) database(tb testing.TB) (string, func()) {
	tb.Helper()
	name := strings.ReplaceAll(stack.UniqueName("peers"), "-", "_")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s.admin(tb, ctx, fmt.Sprintf("CREATE DATABASE %s TEMPLATE %s", pgx.Identifier{name}.Sanitize(), pgx.Identifier{s.tmpl}.Sanitize()))
	var once sync.Once
	drop := func() {
		once.Do(func() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			s.dropSlots(tb, ctx, name)
			s.admin(tb, ctx, fmt.Sprintf("DROP DATABASE IF EXISTS %s WITH (FORCE)", pgx.Identifier{name}.Sanitize()))
		})
	}
	tb.Cleanup(drop)
	return stack.WithDatabase(s.url, name), drop
}

// dropSlots drops the replication slots of database name. A peer that just
// exited may still have its walsender on the slot for a moment: that one is
// ended and the drop tried again, until none is left.
func (s *server) dropSlots(tb testing.TB, ctx context.Context, name string) {
	tb.Helper()
	conn, err := pgx.Connect(ctx, s.url)
	if err != nil {
		tb.Fatalf("connect %s: %v", s.url, err)
	}
	defer conn.Close(ctx)
	for {
		var left int
		err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE database = $1`, name).Scan(&left)
		if err == nil && left == 0 {
			return
		}
		if err == nil {
			_, err = conn.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = $1 AND active`, name)
		}
		if err == nil {
			_, err = conn.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1 AND NOT active`, name)
		}
		select {
		case <-ctx.Done():
			tb.Fatalf("drop the replication slots of %s: %v (last error: %v)", name, ctx.Err(), err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// createTopic creates a topic with the publisher bench's partition count;
// the returned function deletes it (a 100 MB log per run would otherwise
// stay in the broker's page cache for the runs after it).
func createTopic(tb testing.TB, brokers []string) (string, func()) {
	tb.Helper()
	topic := stack.UniqueName("bench-peers")
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 30 * time.Second}
	resp, err := client.CreateTopics(context.Background(), &kafka.CreateTopicsRequest{
		Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: partitions, ReplicationFactor: 1}},
	})
	if err == nil {
		err = resp.Errors[topic]
	}
	if err != nil {
		tb.Fatalf("create topic %s: %v", topic, err)
	}
	var once sync.Once
	drop := func() {
		once.Do(func() {
			_, _ = client.DeleteTopics(context.Background(), &kafka.DeleteTopicsRequest{Topics: []string{topic}})
		})
	}
	tb.Cleanup(drop)
	return topic, drop
}

// arrival is one record as the consumer saw it.
type arrival struct {
	at      time.Time
	key     string
	value   []byte
	headers map[string]string
}

// consumer reads every partition of a topic from the start and timestamps
// each record when it is handed over by the client: that is when a
// downstream reader could act on it.
type consumer struct {
	client *kgo.Client
	keep   bool // keep values and headers (the routing test); the benches keep the time only

	mu       sync.Mutex
	events   map[string]struct{}  // event ids seen: the publisher's ce_id, the EventRouter's id
	times    []time.Time          // arrival of each distinct event, in order
	first    map[string]time.Time // key → first arrival
	records  []arrival
	n, dupes int
	firstAt  time.Time
	lastAt   time.Time
	waiters  []waiter
	stopped  chan struct{}
	stopOnce sync.Once
}

type waiter struct {
	n  int
	ch chan struct{}
}

func newConsumer(tb testing.TB, brokers []string, topic string, keep bool) *consumer {
	tb.Helper()
	client, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(100*time.Millisecond))
	if err != nil {
		tb.Fatalf("kafka consumer: %v", err)
	}
	c := &consumer{client: client, keep: keep, events: map[string]struct{}{}, first: map[string]time.Time{}, stopped: make(chan struct{})}
	go c.loop()
	tb.Cleanup(c.close)
	return c
}

func (c *consumer) loop() {
	defer close(c.stopped)
	for {
		fetches := c.client.PollFetches(context.Background())
		if fetches.IsClientClosed() {
			return
		}
		now := time.Now()
		c.mu.Lock()
		fetches.EachRecord(func(r *kgo.Record) {
			key := string(r.Key)
			id := eventID(r)
			if _, seen := c.events[id]; seen {
				c.dupes++
			} else {
				c.events[id] = struct{}{}
				c.times = append(c.times, now)
			}
			if _, seen := c.first[key]; !seen {
				c.first[key] = now
			}
			if c.n == 0 {
				c.firstAt = now
			}
			c.n++
			c.lastAt = now
			if c.keep {
				hs := map[string]string{}
				for _, h := range r.Headers {
					hs[h.Key] = string(h.Value)
				}
				c.records = append(c.records, arrival{at: now, key: key, value: r.Value, headers: hs})
			}
		})
		c.waiters = wake(c.waiters, len(c.events))
		c.mu.Unlock()
	}
}

// eventID is the event id a record carries: the publisher's CloudEvents
// ce_id, or the id header Debezium's EventRouter adds (from event_id).
func eventID(r *kgo.Record) string {
	for _, h := range r.Headers {
		if h.Key == "ce_id" || h.Key == "id" {
			return string(h.Value)
		}
	}
	return ""
}

func wake(ws []waiter, have int) []waiter {
	kept := ws[:0]
	for _, w := range ws {
		if have >= w.n {
			close(w.ch)
		} else {
			kept = append(kept, w)
		}
	}
	return kept
}

// waitDistinct waits until n distinct events arrived or the timeout passes;
// it reports whether they did.
func (c *consumer) waitDistinct(n int, timeout time.Duration) bool {
	c.mu.Lock()
	if len(c.events) >= n {
		c.mu.Unlock()
		return true
	}
	w := waiter{n: n, ch: make(chan struct{})}
	c.waiters = append(c.waiters, w)
	c.mu.Unlock()
	select {
	case <-w.ch:
		return true
	case <-time.After(timeout):
		return false
	}
}

// arrived returns when key first arrived.
func (c *consumer) arrived(key string) (time.Time, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	t, ok := c.first[key]
	return t, ok
}

func (c *consumer) close() {
	c.stopOnce.Do(func() {
		c.client.Close()
		<-c.stopped
	})
}

// peer is a relay under test, run as its own process.
type peer struct {
	name string
	// prepare runs before the rows are written (Debezium: create the slot
	// and publication, so a backlog written after it is streamed).
	prepare func(tb testing.TB, dbURL string)
	start   func(tb testing.TB, dbURL string) *testproc.Proc
}

func debeziumScript() string {
	return filepath.Join(stack.RepoRoot(), "bench", "peers", "debezium", "debezium.sh")
}

// buildDebezium builds the harness once (a no-op when it is up to date).
func buildDebezium(tb testing.TB) {
	tb.Helper()
	p := testproc.Run(tb, 20*time.Minute, "bash", nil, debeziumScript(), "build")
	if p.ExitCode() != 0 {
		tb.Fatalf("debezium.sh build: exit %d\n%s", p.ExitCode(), p.Stderr())
	}
}

// debeziumPeer runs the harness with its settings plus extra --set flags.
func debeziumPeer(name string, brokers []string, set ...string) peer {
	var args []string
	for _, s := range set {
		args = append(args, "--set", s)
	}
	return peer{
		name: name,
		prepare: func(tb testing.TB, dbURL string) {
			p := testproc.Run(tb, 5*time.Minute, "bash", nil, debeziumScript(), "setup", "--database-url", dbURL)
			if p.ExitCode() != 0 {
				tb.Fatalf("debezium.sh setup: exit %d\n%s", p.ExitCode(), p.Stderr())
			}
		},
		start: func(tb testing.TB, dbURL string) *testproc.Proc {
			offsets := filepath.Join(tb.TempDir(), "offsets.dat")
			return testproc.Start(tb, "bash", nil, append([]string{debeziumScript(), "run", "--database-url", dbURL,
				"--brokers", strings.Join(brokers, ","), "--offsets", offsets}, args...)...)
		},
	}
}

// publisherPeer runs cmd/publisher with its defaults.
func publisherPeer(binary string, brokers []string) peer {
	return peer{
		name:    "publisher",
		prepare: func(testing.TB, string) {},
		start: func(tb testing.TB, dbURL string) *testproc.Proc {
			return testproc.Start(tb, binary, nil, "run", "--database-url", dbURL, "--kafka-brokers", strings.Join(brokers, ","),
				"--metrics-addr", "", "--log-level", "warn")
		},
	}
}

// stop sends SIGTERM, waits for the exit and returns the CPU time the
// process used (read just before the signal: a dead process has no
// /proc entry).
func stop(tb testing.TB, name string, p *testproc.Proc) time.Duration {
	tb.Helper()
	cpu := processCPU(p.Cmd.Process.Pid)
	_ = p.Signal(syscall.SIGTERM)
	if err := p.Wait(time.Minute); err != nil {
		tb.Errorf("%s: did not exit cleanly after SIGTERM: %v\nstderr:\n%s", name, err, tail(p.Stderr(), 30))
	}
	return cpu
}

// processCPU is the user+system time of a process from /proc (0 if gone).
func processCPU(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// Fields after the parenthesised command name; utime and stime are the
	// 14th and 15th fields of the line, in clock ticks (100 per second).
	s := string(b)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(fields) < 13 {
		return 0
	}
	u, _ := strconv.ParseInt(fields[11], 10, 64)
	st, _ := strconv.ParseInt(fields[12], 10, 64)
	return time.Duration(u+st) * 10 * time.Millisecond
}

func tail(s string, n int) string {
	var lines []string
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// waitReady writes a probe transaction every second until every event of
// one of them came out of the topic: then the peer holds its shards
// (publisher) or streams from its slot (Debezium). A probe has one event in
// each of the outbox's 64 partitions: Debezium reads a partition's schema
// from the database the first time it sees a change from it (pgoutput
// sends a relation message per partition, even via the root), which on a
// loaded machine takes seconds for all 64; a peer is ready once that is
// behind it. It returns how many probe events it wrote (they all arrive,
// some perhaps after it returns).
func waitReady(tb testing.TB, pool *pgxpool.Pool, c *consumer, topic string, p *testproc.Proc, name string) int {
	tb.Helper()
	start := time.Now()
	deadline := start.Add(5 * time.Minute)
	var probes [][]string
	for i := 0; ; i++ {
		var keys []string
		if err := pool.QueryRow(context.Background(), probeKeysSQL, i).Scan(&keys); err != nil {
			tb.Fatalf("probe keys: %v", err)
		}
		probes = append(probes, keys)
		insertEvents(tb, pool, topic, keys, 1)
		for until := time.Now().Add(time.Second); time.Now().Before(until); {
			for _, keys := range probes {
				all := true
				for _, k := range keys {
					if _, ok := c.arrived(k); !ok {
						all = false
						break
					}
				}
				if all {
					n := 0
					for _, keys := range probes {
						n += len(keys)
					}
					return n
				}
			}
			select {
			case <-p.Done():
				tb.Fatalf("%s exited before it was ready: exit %d\nstderr:\n%s", name, p.ExitCode(), tail(p.Stderr(), 40))
			case <-time.After(20 * time.Millisecond):
			}
		}
		if time.Now().After(deadline) {
			tb.Fatalf("%s: no whole probe on %s after 5 minutes\nstderr:\n%s", name, topic, tail(p.Stderr(), 40))
		}
	}
}

// probeKeysSQL picks one key per outbox partition for probe $1.
const probeKeysSQL = `
SELECT array_agg(k) FROM (
	SELECT DISTINCT ON (outboxrelay_shard(k)) k
	FROM (SELECT 'probe-' || $1::int || '-' || g AS k FROM generate_series(1, 5000) AS g) AS candidates
	ORDER BY outboxrelay_shard(k), k
) AS one_per_shard`

// insertSQL writes outbox rows the way both peers read them: topic and
// aggregate type are both the Kafka topic (the publisher routes by the
// topic column, Debezium's EventRouter by aggregate type), the aggregate id
// is the key, and the payload a ~500-byte JSON document.
const insertSQL = `
INSERT INTO outbox_events (event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload)
SELECT gen_random_uuid(), $1, $1, k, $2, 'upsert', json_build_object('key', k, 'pad', repeat('x', $3))
FROM unnest($4::text[]) AS k`

// insertEvents writes one event per key in one transaction.
func insertEvents(tb testing.TB, pool *pgxpool.Pool, topic string, keys []string, version int64) {
	tb.Helper()
	if _, err := pool.Exec(context.Background(), insertSQL, topic, version, payloadPad, keys); err != nil {
		tb.Fatalf("insert outbox rows: %v", err)
	}
}

// counts is what the consumer has seen so far.
type counts struct {
	records, distinct, dupes int
	first, last              time.Time
	p10, p90                 time.Time // when the first 10% and 90% of the distinct events had arrived
}

func (c *consumer) counts() counts {
	c.mu.Lock()
	defer c.mu.Unlock()
	r := counts{records: c.n, distinct: len(c.events), dupes: c.dupes, first: c.firstAt, last: c.lastAt}
	if n := len(c.times); n > 0 {
		r.p10, r.p90 = c.times[n/10], c.times[n*9/10]
	}
	return r
}

// kept returns a copy of the records seen (consumers made with keep).
func (c *consumer) kept() []arrival {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]arrival(nil), c.records...)
}
