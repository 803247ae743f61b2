package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

const (
	// rfSeedEnv replays a TestRandomFollow history: the writers' choices
	// (operation, rows, values, pauses), the long writers' and the kills'
	// schedule. The processes' timing still varies.
	rfSeedEnv = "E2E_RFOLLOW_SEED"
	// rfDurationEnv is how long the writers write (default rfDuration).
	rfDurationEnv = "E2E_RFOLLOW_DURATION"
	rfDuration    = 60 * time.Second
	// rfSeedRows are the rows before the history.
	rfSeedRows = 2000
	// rfOut is the tenant outside the job's filter.
	rfOut = "out"
	// rfCatchUp: once the writers stop, the index must equal the source
	// within this long, with no manual run.
	rfCatchUp = 30 * time.Second
	// The leases and the session are short, so a SIGKILLed process's work
	// moves within seconds.
	rfFollowerLease  = 3 * time.Second
	rfPublisherLease = 2 * time.Second
	rfSession        = 6 * time.Second // the broker's minimum
	// rfOpenWritersWait is shorter than some long writers, so a run start
	// gives up on them and the follower tries again.
	rfOpenWritersWait = 3 * time.Second
)

// TestRandomFollow is a randomized history against `batcher run --follow`
// (an incremental job, vanished: delete, the follow trigger and the delete
// capture installed, a filter and partitions by tenant), the publisher and
// the indexer, each a real process under a supervisor that starts it again
// when it dies. Concurrent writers insert, update, soft-delete and revive
// rows, hard-delete them, insert deleted ids again with the version reset
// to 1, move rows out of the filter and back in, and now and then
// TRUNCATE the table (putting some of its rows back in the same
// transaction); long writers hold changes open for longer than a chunk,
// some for longer than OPEN_WRITERS_WAIT; meanwhile a random process is
// SIGKILLed every few seconds. Once the writers stop, with no manual run,
// the index must equal the source table within rfCatchUp (checked from
// the source table as it is then): the independent oracle
// (oracle_test.go) compares what the read alias finds with the documents
// computed by SQL from the source table over a new connection (every
// in-scope live row at its latest content and version, every soft-deleted
// one a tombstone, nothing else visible); and it must still do so once the
// outbox and the topic are drained. The choices come from a printed seed
// (E2E_RFOLLOW_SEED replays them); E2E_RFOLLOW_DURATION sets the history's
// length (at least 30s: the test requires every kind of operation and of
// kill to have happened).
func TestRandomFollow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	seed := testproc.Seed(t, rfSeedEnv)
	history := rfDuration
	if v := os.Getenv(rfDurationEnv); v != "" {
		d, err := time.ParseDuration(v)
		require.NoError(t, err, rfDurationEnv)
		history = d
	}

	p := newPipeline(t, pipelineOptions{
		TopicPartitions: 3,
		PartitionBy:     "tenant_id",
		// Small chunks: a run of many commits, for the kills to land
		// between, shorter than a long writer.
		Chunk: batch.ChunkSettings{Size: 200, Min: 100, Max: 400},
	})
	p.spec.Job = "records-rfollow"
	p.spec.Mode = batch.ModeIncremental
	p.spec.Source.Cursor = []string{"change_seq"}
	p.spec.Vanished = batch.VanishedDelete
	p.spec.Source.Filter = []batch.Condition{{Column: "tenant_id", Op: "!=", Value: rfOut}}
	// The oracle: rows outside the filter must not be found; the deletes
	// of gone rows are tombstones; a row inserted again after a delete
	// (the writers mark it "reborn" in its payload, which the documents do
	// not carry) is indexed above its tombstone's version.
	p.expect.ScopeSQL = `s.tenant_id <> '` + rfOut + `'`
	p.expect.GoneTombstones = true
	p.expect.VersionAboveSQL = `s.payload ? 'reborn'`
	b, err := json.MarshalIndent(p.spec, "", "  ")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p.specFile, b, 0o644))
	require.NoError(t, demo.Seed(ctx, p.pool, demo.SeedOptions{Rows: rfSeedRows}))
	tr := testproc.Run(t, time.Minute, p.batcherBin, p.env(), "follow-trigger", "--spec", p.specFile, "--install")
	require.Equal(t, 0, tr.ExitCode(), "follow-trigger --install:\n%s", tr.Stderr())
	var maxID int64
	require.NoError(t, p.pool.QueryRow(ctx, `SELECT max(id) FROM source_records`).Scan(&maxID))

	h := &rfHistory{t: t, p: p, rng: rand.New(rand.NewPCG(seed, 26)), nextID: maxID + 10}
	procCtx, stopProcs := context.WithCancel(ctx)
	defer stopProcs()
	for _, kind := range []string{"follower", "publisher", "indexer"} {
		h.supervise(procCtx, &rfSlot{kind: kind})
	}

	start := time.Now()
	writeCtx, stopWriters := context.WithTimeout(ctx, history)
	defer stopWriters()
	var wg sync.WaitGroup
	const writers = 2
	for i := range writers {
		wg.Add(1)
		go func() { defer wg.Done(); h.write(writeCtx, h.fork(uint64(i))) }()
	}
	wg.Add(2)
	go func() { defer wg.Done(); h.longWriters(writeCtx, h.fork(100)) }()
	go func() { defer wg.Done(); h.kill(writeCtx, h.fork(200)) }()
	wg.Wait()
	stopped := time.Now()
	h.requireNoWriterError()
	t.Logf("writers stopped after %s: %s; kills %v", stopped.Sub(start).Round(time.Millisecond), h.opsSummary(), h.killCounts())

	// The history must have happened for the test to mean anything.
	for _, op := range []string{"insert", "update", "soft-delete", "revive", "hard-delete", "reinsert", "move-out", "move-in", "long", "truncate"} {
		require.Positivef(t, h.opCount(op), "%s operations in the history", op)
	}
	for _, kind := range []string{"follower", "publisher", "indexer"} {
		require.Positivef(t, h.killCount(kind), "SIGKILLs of the %s", kind)
	}

	// No manual run: the follower, publisher and indexer (the last ones
	// the supervisors started) carry the rest within rfCatchUp. A check
	// reads the index when it begins (refresh and scroll) and compares
	// after, which takes seconds on a loaded machine: a check that began
	// within rfCatchUp and finds the index equal passes.
	deadline := stopped.Add(rfCatchUp)
	var c *indexCheck
	var matched time.Duration
	for {
		began := time.Since(stopped)
		c = p.checkIndex(ctx, p.expect)
		if c.ok() {
			matched = began
			break
		}
		if !time.Now().Before(deadline) {
			require.FailNowf(t, "the index differs from the source", "in the check that began %s after the writers stopped: %s\nby kind: %s\n%s",
				began.Round(time.Millisecond), c, rfKinds(c), h.logs())
		}
		t.Logf("oracle: not yet equal in the check that began +%s: %s; %s", began.Round(time.Millisecond), c.summary(), h.where(ctx))
		pause(ctx, 500*time.Millisecond)
	}
	t.Logf("oracle: %s in the check that began +%s after the writers stopped (ended +%s)", c, matched.Round(time.Millisecond), time.Since(stopped).Round(time.Millisecond))

	// And it stays so: once the outbox and the topic are drained (every
	// event written so far indexed, replays included), nothing was
	// resurrected or went stale.
	h.waitDrained(ctx, time.Minute)
	c = p.checkIndex(ctx, p.expect)
	require.Truef(t, c.ok(), "the index differs from the source once drained: %s\nby kind: %s\n%s", c, rfKinds(c), h.logs())
	h.requireNoUnexpectedExit()
	var tombstones int64
	require.NoError(t, p.pool.QueryRow(ctx, `SELECT coalesce(sum(tombstones), 0) FROM batch_delete_marks WHERE job = $1`, p.spec.Job).Scan(&tombstones))
	stopProcs()
	h.procs.Wait()

	report(t, "seed %d, history %s: %s; SIGKILLs %v; %d restarts (%d follower exits after a lost lease); %d run starts given up after OPEN_WRITERS_WAIT; %d tombstones written by drains",
		seed, history, h.opsSummary(), h.killCounts(), h.restarts.Load(), h.leaseLost.Load(), h.gaveUp(), tombstones)
	report(t, "writers stopped → index found equal to the source by the check that began +%s (%d live documents, %d tombstones); test %s",
		matched.Round(time.Millisecond), c.Live, c.Tombstones, time.Since(start).Round(time.Millisecond))
}

// rfKinds groups the oracle's differences: missing (an in-scope row, live
// or soft-deleted, with no document), stale (a document at another
// version or with other content), extra (a document or a visible row for
// an id the source does not hold in scope, or live for a deleted row).
func rfKinds(c *indexCheck) string {
	groups := map[string]int{}
	for kind, n := range c.byKind {
		switch kind {
		case "missing", "tombstone-missing", "tombstone-for-live":
			groups["missing"] += n
		case "version", "content", "tombstone-version", "tombstone-content":
			groups["stale"] += n
		case "unexpected", "tombstone-unexpected", "deleted-visible", "write-alias-count":
			groups["extra"] += n
		default:
			groups[kind] += n
		}
	}
	return fmt.Sprint(groups)
}

// rfHistory is the test's writers, kills and supervised processes.
type rfHistory struct {
	t *testing.T
	p *pipeline
	// followerEnv, when set, adds settings ("K=V") to each follower started.
	followerEnv func() []string

	rngMu sync.Mutex
	rng   *rand.Rand // forks the writers' own

	idMu    sync.Mutex
	nextID  int64   // the next id never used
	deleted []int64 // ids hard-deleted or truncated and not inserted again

	ops      sync.Map // op -> *atomic.Int64
	kills    sync.Map // kind -> *atomic.Int64
	restarts atomic.Int64
	// leaseLost: follower exits after a lost lease.
	leaseLost atomic.Int64
	procs     sync.WaitGroup

	mu         sync.Mutex
	slots      []*rfSlot
	writerErr  error
	unexpected []string
}

func (h *rfHistory) fork(stream uint64) *rand.Rand {
	h.rngMu.Lock()
	defer h.rngMu.Unlock()
	return rand.New(rand.NewPCG(h.rng.Uint64(), stream))
}

func (h *rfHistory) count(m *sync.Map, key string) {
	v, _ := m.LoadOrStore(key, new(atomic.Int64))
	v.(*atomic.Int64).Add(1)
}

func (h *rfHistory) get(m *sync.Map, key string) int64 {
	if v, ok := m.Load(key); ok {
		return v.(*atomic.Int64).Load()
	}
	return 0
}

func (h *rfHistory) opCount(op string) int64     { return h.get(&h.ops, op) }
func (h *rfHistory) killCount(kind string) int64 { return h.get(&h.kills, kind) }

func (h *rfHistory) all(m *sync.Map) map[string]int64 {
	out := map[string]int64{}
	m.Range(func(k, v any) bool { out[k.(string)] = v.(*atomic.Int64).Load(); return true })
	return out
}

func (h *rfHistory) opsSummary() string { return fmt.Sprint(h.all(&h.ops)) }
func (h *rfHistory) killCounts() string { return fmt.Sprint(h.all(&h.kills)) }
func (h *rfHistory) newID() int64       { h.idMu.Lock(); defer h.idMu.Unlock(); h.nextID++; return h.nextID }
func (h *rfHistory) idSpace() int64     { h.idMu.Lock(); defer h.idMu.Unlock(); return h.nextID }
func (h *rfHistory) addDeleted(ids ...int64) {
	h.idMu.Lock()
	defer h.idMu.Unlock()
	h.deleted = append(h.deleted, ids...)
}

// takeDeleted removes and returns a random deleted id (0: none).
func (h *rfHistory) takeDeleted(rng *rand.Rand) int64 {
	h.idMu.Lock()
	defer h.idMu.Unlock()
	if len(h.deleted) == 0 {
		return 0
	}
	i := rng.IntN(len(h.deleted))
	id := h.deleted[i]
	h.deleted = slices.Delete(h.deleted, i, i+1)
	return id
}

func (h *rfHistory) fail(ctx context.Context, err error) {
	if err == nil || ctx.Err() != nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.writerErr == nil {
		h.writerErr = err
	}
}

func (h *rfHistory) requireNoWriterError() {
	h.t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	require.NoError(h.t, h.writerErr, "a writer failed")
}

// rfDB is what a writer's statement runs on: the pool or a transaction.
type rfDB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// rfPick is the SQL of one existing row at or after a random id (of the
// rows matching cond), for a writer's single-row change.
func rfPick(cond string) string {
	return `(SELECT id FROM source_records WHERE id >= $1 AND ` + cond + ` ORDER BY id LIMIT 1)`
}

// rfChanges are the ids an operation deleted and those it took off the
// deleted list to insert again: once its transaction commits the first go
// on the list; if it does not, the second go back.
type rfChanges struct{ deleted, taken []int64 }

func (h *rfHistory) apply(ch *rfChanges, committed bool) {
	if committed {
		h.addDeleted(ch.deleted...)
	} else {
		h.addDeleted(ch.taken...)
	}
}

// op makes one random change on db and counts it; the title it writes is
// new each time, so a stale document shows in its content.
func (h *rfHistory) op(ctx context.Context, db rfDB, rng *rand.Rand, tag string, ch *rfChanges) error {
	at := rng.Int64N(h.idSpace())
	title := fmt.Sprintf(" %s edit %d ", tag, rng.Uint32())
	tenant := fmt.Sprintf("tenant-%d", rng.IntN(4))
	var op string
	var err error
	ids := func(sql string, args ...any) []int64 {
		rows, qerr := db.Query(ctx, sql, args...)
		if qerr != nil {
			err = qerr
			return nil
		}
		out, cerr := pgx.CollectRows(rows, pgx.RowTo[int64])
		err = cerr
		return out
	}
	exec := func(sql string, args ...any) {
		_, err = db.Exec(ctx, sql, args...)
	}
	switch n := rng.IntN(100); {
	case n < 22:
		op = "insert"
		if rng.IntN(10) == 0 {
			tenant = rfOut
		}
		exec(`INSERT INTO source_records (id, tenant_id, payload) VALUES ($1, $2, jsonb_build_object('title', $3::text, 'body', 'new', 'tags', jsonb_build_array('n')))`,
			h.newID(), tenant, title)
	case n < 55:
		op = "update"
		exec(`UPDATE source_records SET payload = payload || jsonb_build_object('title', $2::text) WHERE id = `+rfPick(`true`), at, title)
	case n < 63:
		op = "soft-delete"
		exec(`UPDATE source_records SET deleted_at = clock_timestamp() WHERE id = `+rfPick(`deleted_at IS NULL`), at)
	case n < 67:
		op = "revive"
		exec(`UPDATE source_records SET deleted_at = NULL, payload = payload || jsonb_build_object('title', $2::text) WHERE id = `+rfPick(`deleted_at IS NOT NULL`), at, title)
	case n < 77:
		op = "hard-delete"
		// One to three rows; a soft-deleted one as likely as any.
		gone := ids(`DELETE FROM source_records WHERE id IN (SELECT id FROM source_records WHERE id >= $1 ORDER BY id LIMIT $2) RETURNING id`, at, 1+rng.IntN(3))
		ch.deleted = append(ch.deleted, gone...)
	case n < 86:
		op = "reinsert"
		id := h.takeDeleted(rng)
		if id == 0 {
			return nil
		}
		ch.taken = append(ch.taken, id)
		// The version starts at 1 again (the column's default).
		exec(`INSERT INTO source_records (id, tenant_id, payload) VALUES ($1, $2, jsonb_build_object('title', $3::text, 'body', 'again', 'reborn', true))`, id, tenant, title)
	case n < 93:
		op = "move-out"
		exec(`UPDATE source_records SET tenant_id = $2 WHERE id = `+rfPick(`tenant_id <> '`+rfOut+`'`), at, rfOut)
	default:
		op = "move-in"
		exec(`UPDATE source_records SET tenant_id = $2, payload = payload || jsonb_build_object('title', $3::text) WHERE id = `+rfPick(`tenant_id = '`+rfOut+`'`), at, tenant, title)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", op, err)
	}
	h.count(&h.ops, op)
	return nil
}

// rfRetryable: a deadlock between writers (the server ends one) is the
// writers' business, not the product's.
func rfRetryable(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "40P01"
}

// write makes single-statement changes every 20–100 ms until ctx ends.
func (h *rfHistory) write(ctx context.Context, rng *rand.Rand) {
	for ctx.Err() == nil {
		pause(ctx, time.Duration(20+rng.IntN(80))*time.Millisecond)
		var ch rfChanges
		err := h.op(ctx, h.p.pool, rng, "w", &ch)
		h.apply(&ch, err == nil)
		if err != nil && !rfRetryable(err) {
			h.fail(ctx, err)
			return
		}
	}
}

// longWriters, every 2–6 s: a transaction that makes one to three changes
// and commits after 2–5 s (longer than a chunk, and some longer than
// OPEN_WRITERS_WAIT), one time in ten rolls back instead; and at two
// random moments of the history (the first in its first half, the second
// in its first 80%) a TRUNCATE
// that puts a random half of the rows back in the same transaction, with
// their versions reset.
func (h *rfHistory) longWriters(ctx context.Context, rng *rand.Rand) {
	history := time.Until(rfDeadline(ctx))
	truncates := []time.Time{
		time.Now().Add(time.Duration(rng.Int64N(int64(history / 2)))),
		time.Now().Add(time.Duration(rng.Int64N(int64(history * 8 / 10)))),
	}
	slices.SortFunc(truncates, time.Time.Compare)
	for ctx.Err() == nil {
		pause(ctx, time.Duration(2000+rng.IntN(4000))*time.Millisecond)
		if ctx.Err() != nil {
			return
		}
		var err error
		if len(truncates) > 0 && time.Now().After(truncates[0]) {
			truncates = truncates[1:]
			err = h.truncate(ctx, rng)
		} else {
			err = h.long(ctx, rng)
		}
		if err != nil && !rfRetryable(err) {
			h.fail(ctx, err)
			return
		}
	}
}

func rfDeadline(ctx context.Context) time.Time {
	d, ok := ctx.Deadline()
	if !ok {
		panic("no deadline")
	}
	return d
}

func (h *rfHistory) long(ctx context.Context, rng *rand.Rand) error {
	// The commit is not cut short by the history's end.
	tx, err := h.p.pool.Begin(context.WithoutCancel(ctx))
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	var ch rfChanges
	for range 1 + rng.IntN(3) {
		if err := h.op(context.WithoutCancel(ctx), tx, rng, "long", &ch); err != nil {
			h.apply(&ch, false)
			return err
		}
	}
	hold := time.Duration(2000+rng.IntN(3000)) * time.Millisecond
	rollback := rng.IntN(10) == 0
	t := time.NewTimer(hold) // the writer's hold (its workload, not a synchronization)
	<-t.C
	if rollback {
		h.apply(&ch, false)
		h.count(&h.ops, "long-rollback")
		return tx.Rollback(context.WithoutCancel(ctx))
	}
	err = tx.Commit(context.WithoutCancel(ctx))
	h.apply(&ch, err == nil)
	if err == nil {
		h.count(&h.ops, "long")
	}
	return err
}

func (h *rfHistory) truncate(ctx context.Context, rng *rand.Rand) error {
	tx, err := h.p.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, `LOCK TABLE source_records IN ACCESS EXCLUSIVE MODE`); err != nil {
		return err
	}
	rows, err := tx.Query(ctx, `SELECT id FROM source_records`)
	if err != nil {
		return err
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `TRUNCATE source_records`); err != nil {
		return err
	}
	var back, gone []int64
	for _, id := range ids {
		if rng.IntN(2) == 0 {
			back = append(back, id)
		} else {
			gone = append(gone, id)
		}
	}
	if _, err := tx.Exec(ctx, `
INSERT INTO source_records (id, tenant_id, payload)
SELECT id, 'tenant-' || (id % 4), jsonb_build_object('title', 'after truncate ' || id, 'reborn', true) FROM unnest($1::bigint[]) id`, back); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	h.addDeleted(gone...)
	h.count(&h.ops, "truncate")
	return nil
}

// kill SIGKILLs one of the three processes every 4–8 s until ctx ends,
// each kind once in every three kills, in a random order. (A killed
// indexer stops the consumer group's consumption for at least the session
// timeout, until the broker drops the dead member: killed more often, the
// indexers would be down most of the time.)
func (h *rfHistory) kill(ctx context.Context, rng *rand.Rand) {
	var order []int
	for ctx.Err() == nil {
		pause(ctx, time.Duration(4000+rng.IntN(4000))*time.Millisecond)
		if ctx.Err() != nil {
			return
		}
		if len(order) == 0 {
			order = rng.Perm(3)
		}
		h.mu.Lock()
		s := h.slots[order[0]]
		h.mu.Unlock()
		order = order[1:]
		if pr := s.current(); pr != nil && pr.Signal(syscall.SIGKILL) == nil {
			h.count(&h.kills, s.kind)
		}
	}
}

// rfSlot is one supervised process.
type rfSlot struct {
	kind string
	mu   sync.Mutex
	proc *testproc.Proc
	all  []*testproc.Proc // every process started, the current one last
}

func (s *rfSlot) current() *testproc.Proc {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc
}

func (h *rfHistory) start(kind string) *testproc.Proc {
	p := h.p
	switch kind {
	case "publisher":
		return p.startPublisher("LOG_LEVEL=warn", "LEASE_TTL="+rfPublisherLease.String(), "POLL_INTERVAL=200ms", "PUBLISHER_ID=rf-"+itoa(time.Now().UnixNano()))
	case "indexer":
		return p.startIndexer("LOG_LEVEL=warn", "FLUSH_INTERVAL=100ms", "SESSION_TIMEOUT="+rfSession.String(), "HEARTBEAT_INTERVAL=1s")
	default:
		env := []string{"LOG_LEVEL=warn", "LEASE_TTL=" + rfFollowerLease.String(), "OPEN_WRITERS_WAIT=" + rfOpenWritersWait.String()}
		if h.followerEnv != nil {
			env = append(env, h.followerEnv()...)
		}
		return p.startFollower(env...)
	}
}

// supervise starts the slot's process and starts it again whenever it
// dies, until ctx ends. An exit other than by SIGKILL is recorded as
// unexpected, except a follower's after a lost lease (stalled past
// LEASE_TTL on a loaded machine, it stops without writing, as documented:
// the supervisor starts it again), which is counted.
func (h *rfHistory) supervise(ctx context.Context, s *rfSlot) {
	h.mu.Lock()
	h.slots = append(h.slots, s)
	h.mu.Unlock()
	h.procs.Add(1)
	go func() {
		defer h.procs.Done()
		for ctx.Err() == nil {
			pr := h.start(s.kind)
			s.mu.Lock()
			s.proc = pr
			s.all = append(s.all, pr)
			s.mu.Unlock()
			select {
			case <-ctx.Done():
				return
			case <-pr.Done():
			}
			h.restarts.Add(1)
			switch {
			case pr.Killed():
			case s.kind == "follower" && strings.Contains(pr.Stderr(), batch.ErrLeaseLost.Error()):
				h.leaseLost.Add(1)
			default:
				h.mu.Lock()
				h.unexpected = append(h.unexpected, fmt.Sprintf("%s exited with %v:\n%s", s.kind, pr.Cmd.ProcessState, tail(pr.Stderr(), 20)))
				h.mu.Unlock()
			}
		}
	}()
}

// gaveUp counts the followers' run starts given up on after
// OPEN_WRITERS_WAIT (their warning).
func (h *rfHistory) gaveUp() int {
	n := 0
	for _, s := range h.slots {
		if s.kind != "follower" {
			continue
		}
		s.mu.Lock()
		for _, pr := range s.all {
			n += strings.Count(pr.Stderr(), "the run did not start; trying again")
		}
		s.mu.Unlock()
	}
	return n
}

func (h *rfHistory) requireNoUnexpectedExit() {
	h.t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	require.Empty(h.t, h.unexpected, "processes that exited on their own")
}

func (h *rfHistory) logs() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var b strings.Builder
	for _, u := range h.unexpected {
		fmt.Fprintf(&b, "--- exited: %s\n", u)
	}
	for _, s := range h.slots {
		if pr := s.current(); pr != nil {
			fmt.Fprintf(&b, "--- %s:\n%s\n", s.kind, tail(pr.Stderr(), 15))
		}
	}
	return b.String()
}

// where says where the pipeline stands: the job's runs by state, the
// outbox backlog and the consumer lag.
func (h *rfHistory) where(ctx context.Context) string {
	backlog := h.p.outboxBacklog(ctx)
	st, err := h.p.status(ctx)
	return fmt.Sprintf("runs %v, outbox %d, lag %d %v", h.p.runStates(ctx), backlog, lagOf(st), err)
}

// waitDrained waits until the outbox is empty and the indexers' consumer
// group has no lag.
func (h *rfHistory) waitDrained(ctx context.Context, timeout time.Duration) {
	h.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		backlog := h.p.outboxBacklog(ctx)
		st, err := h.p.status(ctx)
		if backlog == 0 && err == nil && st.TotalLag() == 0 {
			return
		}
		require.Truef(h.t, time.Now().Before(deadline), "not drained after %s: outbox %d, lag %d (%v)\n%s", timeout, backlog, lagOf(st), err, h.logs())
		pause(ctx, 250*time.Millisecond)
	}
}
