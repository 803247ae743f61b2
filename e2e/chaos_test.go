package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// Lease and session settings of the chaos test: short, so a SIGSTOPped
// process is overtaken within seconds.
const (
	chaosBatcherLease   = 3 * time.Second
	chaosPublisherLease = 2 * time.Second
	chaosIndexerSession = 6 * time.Second // the broker's minimum
	chaosBadEvery       = 499
	// chaosSeedEnv replays the chaos's choices (which process, kill or
	// stop, the pauses between them) from the seed a run printed; the
	// timing of the processes and the mutator's random() rows still vary.
	chaosSeedEnv = "E2E_CHAOS_SEED"
)

// TestPipelineChaos runs two of each binary while the source keeps
// changing, and SIGKILLs (or SIGSTOPs past its lease, then SIGCONTs) a
// random process every few seconds; supervisors restart what dies and
// batchers start the next run when one finishes. The chaos stops by itself
// (E2E_CHAOS_DURATION, default 150s); then a last batcher run covers the
// last source change and, once the pipeline has drained, the index must
// equal the source exactly. The choices come from a seed it prints
// (E2E_CHAOS_SEED replays them).
func TestPipelineChaos(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	chaosFor := 150 * time.Second
	if v := os.Getenv("E2E_CHAOS_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		require.NoError(t, err, "E2E_CHAOS_DURATION")
		chaosFor = d
	}
	seed := testproc.Seed(t, chaosSeedEnv)
	p := newPipeline(t, pipelineOptions{
		TopicPartitions: 6,
		// tenant_id has 4 values: 4 partitions for the two batchers to share.
		PartitionBy: "tenant_id",
		// Small chunks: a run has many commits for the kills to land between.
		Chunk: batch.ChunkSettings{Size: 300, Min: 100, Max: 1500, TargetDuration: batch.Duration(300 * time.Millisecond)},
	})
	require.NoError(t, demo.Seed(ctx, p.pool, demo.SeedOptions{Rows: 20_000, BadEvery: chaosBadEvery}))

	c := &chaos{t: t, p: p, rng: rand.New(rand.NewPCG(seed, 42))}
	// Daemons stay supervised until the end of the test; batchers and the
	// chaos itself stop when the chaos ends.
	daemonCtx, stopDaemons := context.WithCancel(ctx)
	chaosCtx, stopChaos := context.WithCancel(ctx)
	defer stopDaemons()
	defer stopChaos()
	for i := 1; i <= 2; i++ {
		c.add(daemonCtx, &c.daemons, &slot{name: fmt.Sprintf("publisher-%d", i), kind: "publisher", stopFor: chaosPublisherLease + 1500*time.Millisecond})
		c.add(daemonCtx, &c.daemons, &slot{name: fmt.Sprintf("indexer-%d", i), kind: "indexer", stopFor: chaosIndexerSession + 2*time.Second})
		c.add(chaosCtx, &c.wg, &slot{name: fmt.Sprintf("batcher-%d", i), kind: "batcher", stopFor: chaosBatcherLease + 1500*time.Millisecond})
	}

	start := time.Now()
	var bg sync.WaitGroup
	bg.Add(2)
	go func() { defer bg.Done(); c.mutate(chaosCtx) }()
	go func() { defer bg.Done(); c.sample(chaosCtx) }()
	c.run(chaosCtx, chaosFor)
	stopChaos()
	bg.Wait()
	c.wg.Wait() // SIGCONTs sent, batcher supervisors stopped
	chaosEnd := time.Now()

	// Batchers still running are told to stop at their last checkpoint.
	for _, s := range c.slots {
		if s.kind != "batcher" {
			continue
		}
		if pr := s.current(); pr != nil {
			t0 := time.Now()
			_ = pr.Signal(syscall.SIGTERM)
			_ = pr.Wait(time.Minute)
			if time.Since(t0) > 5*time.Second {
				t.Logf("%s took %s to stop after SIGTERM:\n%s\nsessions then:\n%s", s.name, time.Since(t0), tail(pr.Stderr(), 40), c.sessions(ctx))
			}
		}
	}
	c.requireNoUnexpected()
	t.Logf("chaos stopped %s after the start; batchers stopped +%s", chaosEnd.Sub(start).Round(time.Millisecond), time.Since(chaosEnd).Round(time.Millisecond))

	// The last runs: the first finishes the run in progress (if any), the
	// second starts after the last source change, so it sees every change.
	for range 2 {
		p.runBatcher(3*time.Minute, "--workers", "4", "--lease-ttl", chaosBatcherLease.String())
	}
	var unfinished int
	require.NoError(t, p.pool.QueryRow(ctx, `SELECT count(*) FROM batch_runs WHERE state NOT IN ('succeeded', 'superseded')`).Scan(&unfinished))
	require.Zero(t, unfinished, "batch partitions not succeeded after the final run")
	batched := time.Now()

	s := p.waitSettled(ctx, 3*time.Minute, c.logs)
	settledAt := time.Now()
	c.requireNoUnexpected()

	live := p.assertIndexEqualsSource(ctx)
	t.Logf("index checked against the source +%s", time.Since(chaosEnd).Round(time.Millisecond))
	require.Zero(t, p.outboxBacklog(ctx), "outbox drained")
	pubDL, ixDL := p.deadLetters(ctx)
	require.Zero(t, pubDL, "publisher dead letters")
	require.Zero(t, ixDL, "indexer dead letters")
	records, dups := p.topicStats(ctx)
	t.Logf("topic read +%s", time.Since(chaosEnd).Round(time.Millisecond))
	conflicts := c.conflicts()
	stopDaemons()
	c.daemons.Wait()

	var runs, failedAttempts int64
	require.NoError(t, p.pool.QueryRow(ctx, `SELECT count(DISTINCT logical_run_id), coalesce(sum(attempt - 1) FILTER (WHERE attempt > 1), 0) FROM batch_runs`).Scan(&runs, &failedAttempts))

	// The chaos must have happened for the test to mean anything.
	require.Positive(t, c.kills.Load(), "kills")
	require.Positive(t, c.restarts.Load(), "restarts")
	require.Positive(t, c.inserted.Load(), "inserted rows")
	require.Positive(t, c.updated.Load(), "updated rows")
	require.Positive(t, c.deleted.Load(), "soft-deleted rows")
	require.GreaterOrEqual(t, runs, int64(3), "batcher runs")

	report(t, "chaos %s: %d SIGKILLs %v, %d SIGSTOP/SIGCONTs %v, %d restarts, %d batcher exits after a lost lease, %d batcher runs completed by the chaos batchers",
		chaosFor, c.kills.Load(), c.byKind(&c.killsBy), c.stops.Load(), c.byKind(&c.stopsBy), c.restarts.Load(), c.leaseLost.Load(), c.runsDone.Load())
	report(t, "source: %d seeded + %d inserted, %d updates, %d soft deletes during the chaos; %d live documents, %d tombstones, %d quarantined; %d logical runs, %d partition re-claims",
		20_000, c.inserted.Load(), c.updated.Load(), c.deleted.Load(), live, s.Report.IndexDocs-live, len(p.quarantined(ctx)), runs, failedAttempts)
	report(t, "duplicates absorbed: %d duplicate ce_id of %d records on the topic (publisher redeliveries); %.0f indexer version conflicts counted by the indexers' /metrics (stale or replayed; lower bound: counts of killed indexers since their last scrape are lost)",
		dups, records, conflicts)
	report(t, "max outbox backlog %d; after the chaos: final batcher runs %s, outbox drained +%s, consumer caught up +%s, index matched +%s; e2e %s (chaos end to index equal to source), test %s",
		c.maxBacklog.Load(), batched.Sub(chaosEnd).Round(time.Millisecond), s.Drained.Round(time.Millisecond), s.Caught.Round(time.Millisecond), s.Matching.Round(time.Millisecond),
		settledAt.Sub(chaosEnd).Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

type chaos struct {
	t     *testing.T
	p     *pipeline
	slots []*slot
	// wg: batcher supervisors and pending SIGCONTs (end with the chaos);
	// daemons: publisher and indexer supervisors (end with the test).
	wg, daemons sync.WaitGroup

	rngMu sync.Mutex
	rng   *rand.Rand

	kills, stops, restarts, leaseLost, runsDone atomic.Int64
	killsBy, stopsBy                            sync.Map // kind -> *atomic.Int64
	inserted, updated, deleted                  atomic.Int64
	maxBacklog                                  atomic.Int64

	mu         sync.Mutex
	unexpected []string
}

// slot is one supervised process: whatever kills it, the supervisor starts
// it again until its context ends.
type slot struct {
	name, kind string
	stopFor    time.Duration // a SIGSTOP lasts this long: past the lease

	mu        sync.Mutex
	proc      *testproc.Proc
	metrics   string  // indexers: /metrics address of the current process
	conflicts float64 // indexers: conflicts of finished processes + last scrape
	lastScrap float64
	stopped   bool // SIGSTOPped (now or earlier) in this incarnation
}

func (s *slot) current() *testproc.Proc {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc
}

func (c *chaos) add(ctx context.Context, wg *sync.WaitGroup, s *slot) {
	c.slots = append(c.slots, s)
	wg.Add(1)
	go func() {
		defer wg.Done()
		c.supervise(ctx, s)
	}()
}

func (c *chaos) start(s *slot) *testproc.Proc {
	p := c.p
	switch s.kind {
	case "publisher":
		return p.startPublisher("LOG_LEVEL=warn", "LEASE_TTL="+chaosPublisherLease.String(), "POLL_INTERVAL=200ms", "PUBLISHER_ID="+s.name+"-"+itoa(time.Now().UnixNano()))
	case "indexer":
		addr := freeAddr(c.t)
		s.mu.Lock()
		s.metrics = addr
		s.mu.Unlock()
		return p.startIndexer("LOG_LEVEL=info", "METRICS_ADDR="+addr, "LANES=3", "FLUSH_INTERVAL=100ms",
			"SESSION_TIMEOUT="+chaosIndexerSession.String(), "HEARTBEAT_INTERVAL=1s")
	default:
		return testproc.Start(c.t, p.batcherBin, p.env("LOG_LEVEL=info"), "run", "--spec", p.specFile,
			"--workers", "2", "--lease-ttl", chaosBatcherLease.String(), "--worker-id", s.name+"-"+itoa(time.Now().UnixNano()))
	}
}

func (c *chaos) supervise(ctx context.Context, s *slot) {
	for ctx.Err() == nil {
		pr := c.start(s)
		s.mu.Lock()
		s.proc, s.stopped = pr, false
		s.mu.Unlock()
		select {
		case <-ctx.Done():
			return
		case <-pr.Done():
		}
		s.mu.Lock()
		stopped := s.stopped
		s.conflicts += s.lastScrap
		s.lastScrap = 0
		s.mu.Unlock()
		switch {
		case pr.Killed():
			c.restarts.Add(1)
		case s.kind == "batcher" && pr.ExitCode() == 0:
			c.runsDone.Add(1)
		case s.kind == "batcher" && strings.Contains(pr.Stderr(), batch.ErrLeaseLost.Error()):
			// Overtaken while frozen, or its session ended by the server
			// while frozen in a transaction: it stops without writing.
			c.leaseLost.Add(1)
			c.restarts.Add(1)
		default:
			c.mu.Lock()
			c.unexpected = append(c.unexpected, fmt.Sprintf("%s exited with %v (SIGSTOPped before: %v):\n%s", s.name, pr.Cmd.ProcessState, stopped, tail(pr.Stderr(), 15)))
			c.mu.Unlock()
			c.restarts.Add(1)
		}
	}
}

func (c *chaos) requireNoUnexpected() {
	c.t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	require.Empty(c.t, c.unexpected, "processes that exited on their own")
}

func (c *chaos) logs() string {
	var b strings.Builder
	for _, s := range c.slots {
		if pr := s.current(); pr != nil {
			fmt.Fprintf(&b, "--- %s:\n%s\n", s.name, tail(pr.Stderr(), 10))
		}
	}
	return b.String()
}

// sessions describes the database's sessions that wait or sit in a
// transaction (to explain a slow stop).
func (c *chaos) sessions(ctx context.Context) string {
	rows, err := c.p.pool.Query(ctx, `
SELECT pid, state, coalesce(wait_event_type || '/' || wait_event, '-'), coalesce(now() - xact_start, '0'), pg_blocking_pids(pid)::text, left(regexp_replace(query, '\s+', ' ', 'g'), 120)
FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() AND state <> 'idle'`)
	if err != nil {
		return err.Error()
	}
	defer rows.Close()
	var b strings.Builder
	for rows.Next() {
		var pid int
		var state, wait, blockers, query string
		var age time.Duration
		if err := rows.Scan(&pid, &state, &wait, &age, &blockers, &query); err != nil {
			return err.Error()
		}
		fmt.Fprintf(&b, "  pid %d %s wait %s xact %s blocked by %s: %s\n", pid, state, wait, age.Round(time.Millisecond), blockers, query)
	}
	return b.String()
}

func (c *chaos) intn(n int) int {
	c.rngMu.Lock()
	defer c.rngMu.Unlock()
	return c.rng.IntN(n)
}

func count(m *sync.Map, kind string) {
	v, _ := m.LoadOrStore(kind, new(atomic.Int64))
	v.(*atomic.Int64).Add(1)
}

func (c *chaos) byKind(m *sync.Map) map[string]int64 {
	out := map[string]int64{}
	m.Range(func(k, v any) bool {
		out[k.(string)] = v.(*atomic.Int64).Load()
		return true
	})
	return out
}

// run is the chaos: every 2–4 s a random process is SIGKILLed, or (one
// time in four) SIGSTOPped past its lease and SIGCONTed after.
func (c *chaos) run(ctx context.Context, d time.Duration) {
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		pause(ctx, time.Duration(2000+c.intn(2000))*time.Millisecond)
		s := c.slots[c.intn(len(c.slots))]
		s.mu.Lock()
		pr, stopped := s.proc, s.stopped
		s.mu.Unlock()
		if pr == nil {
			continue
		}
		select {
		case <-pr.Done():
			continue // between runs or restarting
		default:
		}
		if c.intn(4) == 0 && !stopped {
			if pr.Signal(syscall.SIGSTOP) != nil {
				continue
			}
			s.mu.Lock()
			s.stopped = true
			s.mu.Unlock()
			c.stops.Add(1)
			count(&c.stopsBy, s.kind)
			c.wg.Add(1)
			go func() {
				defer c.wg.Done()
				pause(ctx, s.stopFor) // the chaos ending cuts it short
				_ = pr.Signal(syscall.SIGCONT)
			}()
			continue
		}
		if pr.Signal(syscall.SIGKILL) == nil {
			c.kills.Add(1)
			count(&c.killsBy, s.kind)
		}
	}
}

// mutate keeps changing the source: new rows (every chaosBadEvery-th one
// malformed), updates (the trigger bumps the version), repeated updates of
// a few hot rows (many versions of one key in flight), and soft deletes.
// Malformed rows are neither updated nor deleted, so exactly they stay
// quarantined.
func (c *chaos) mutate(ctx context.Context) {
	pool := c.p.pool
	fail := func(err error) {
		if ctx.Err() == nil {
			c.mu.Lock()
			c.unexpected = append(c.unexpected, "mutator: "+err.Error())
			c.mu.Unlock()
		}
	}
	for tick := 0; ctx.Err() == nil; tick++ {
		pause(ctx, 200*time.Millisecond)
		if tick%3 == 0 {
			if err := demo.Seed(ctx, pool, demo.SeedOptions{Rows: 150, BadEvery: chaosBadEvery}); err != nil {
				fail(err)
				return
			}
			c.inserted.Add(150)
		}
		tag, err := pool.Exec(ctx, `
UPDATE source_records SET payload = payload || jsonb_build_object('title', ' Chaos edit of ' || id || ' at ' || clock_timestamp() || ' ')
WHERE id IN (SELECT id FROM source_records WHERE deleted_at IS NULL AND payload->>'title' IS NOT NULL ORDER BY random() LIMIT 30)
   OR id IN (SELECT id FROM source_records WHERE deleted_at IS NULL AND payload->>'title' IS NOT NULL ORDER BY id LIMIT 3)`)
		if err != nil {
			fail(err)
			return
		}
		c.updated.Add(tag.RowsAffected())
		tag, err = pool.Exec(ctx, `
UPDATE source_records SET deleted_at = clock_timestamp()
WHERE id IN (SELECT id FROM source_records WHERE deleted_at IS NULL AND payload->>'title' IS NOT NULL ORDER BY random() LIMIT 6)`)
		if err != nil {
			fail(err)
			return
		}
		c.deleted.Add(tag.RowsAffected())
	}
}

// sample records the largest outbox backlog and the indexers' conflict
// counters.
func (c *chaos) sample(ctx context.Context) {
	for ctx.Err() == nil {
		var n int64
		if err := c.p.pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event_members`).Scan(&n); err == nil && n > c.maxBacklog.Load() {
			c.maxBacklog.Store(n)
		}
		c.scrape(ctx)
		pause(ctx, 500*time.Millisecond)
	}
}

func (c *chaos) scrape(ctx context.Context) {
	for _, s := range c.slots {
		if s.kind != "indexer" {
			continue
		}
		s.mu.Lock()
		addr := s.metrics
		s.mu.Unlock()
		if v := scrapeCounter(ctx, addr, "indexer_docs_total", "conflict"); v >= 0 {
			s.mu.Lock()
			if addr == s.metrics {
				s.lastScrap = max(s.lastScrap, v)
			}
			s.mu.Unlock()
		}
	}
}

// conflicts sums the indexers' version conflicts: finished processes and
// the live ones (scraped now).
func (c *chaos) conflicts() float64 {
	c.scrape(context.Background())
	var sum float64
	for _, s := range c.slots {
		s.mu.Lock()
		sum += s.conflicts + s.lastScrap
		s.mu.Unlock()
	}
	return sum
}
