package batch_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/failpoint"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// TestRandomizedRunsMatchTheModel runs independent histories, each from its
// own seed, until randomBudgetEnv is spent (Go duration, default 2m30s; at
// least one history runs). randomSeedEnv replays the one history of a seed
// it printed; randomDurationEnv sets how long each history's chaos phase
// lasts (default 10s; the rest of a history, its runs after the changes
// stop, takes longer: about 70 s in all under -race on a loaded 2-core
// machine).
const (
	randomSeedEnv     = "OUTBOXRELAY_RANDOM_SEED"
	randomDurationEnv = "OUTBOXRELAY_RANDOM_DURATION"
	randomBudgetEnv   = "OUTBOXRELAY_RANDOM_BUDGET"
)

// The two jobs over rand_records, each with its own source name (so each
// has its own normalized_records rows and its own sweep) and aggregate
// type (so its events can be told apart).
const (
	randFull = "rand_full" // full runs by the random text key, filter hidden = false, vanished rows swept
	randIncr = "rand_incr" // incremental runs by change_seq, no filter
)

const randSchema = `
CREATE SEQUENCE rand_change_seq; -- CACHE 1, as the incremental mode requires
CREATE TABLE rand_records (
    id text PRIMARY KEY,
    version bigint NOT NULL DEFAULT 1,
    change_seq bigint NOT NULL DEFAULT nextval('rand_change_seq') UNIQUE,
    deleted boolean NOT NULL DEFAULT false,
    hidden boolean NOT NULL DEFAULT false,
    title text NOT NULL,
    late boolean NOT NULL DEFAULT false,
    slow_ms int NOT NULL DEFAULT 0
);
-- Hard-deleted ids: never inserted again.
CREATE TABLE rand_graveyard (id text PRIMARY KEY);
CREATE FUNCTION rand_records_bump() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW IS DISTINCT FROM OLD THEN
        NEW.version := OLD.version + 1;
        NEW.change_seq := nextval('rand_change_seq');
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER rand_records_bump BEFORE UPDATE ON rand_records FOR EACH ROW EXECUTE FUNCTION rand_records_bump();
-- A slow BEFORE INSERT trigger: the row holds its change_seq (the DEFAULT
-- ran first) while its transaction has no transaction id yet.
CREATE FUNCTION rand_records_slow() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.slow_ms > 0 THEN PERFORM pg_sleep(NEW.slow_ms / 1000.0); END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER rand_records_slow BEFORE INSERT ON rand_records FOR EACH ROW EXECUTE FUNCTION rand_records_slow();
CREATE FUNCTION rand_records_gone() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO rand_graveyard (id) VALUES (OLD.id) ON CONFLICT DO NOTHING;
    RETURN OLD;
END $$;
CREATE TRIGGER rand_records_gone AFTER DELETE ON rand_records FOR EACH ROW EXECUTE FUNCTION rand_records_gone();
`

// randRow is a source row as the model sees it.
type randRow struct {
	version int64
	deleted bool
	hidden  bool
	title   string
}

// randSnap is the source table read in one snapshot at `at` (the server's
// clock, after the snapshot was taken): every row and every hard-deleted id.
type randSnap struct {
	at   time.Time
	rows map[string]randRow
	gone map[string]bool
}

// Many short runs of the real batcher, two jobs at once over one table
// with random text keys: a full job by the key (with a filter rows leave,
// and the sweep of vanished rows) and an incremental job by a change
// sequence. Meanwhile rows are inserted (many right inside the ranges of
// the full job's chunks in flight), updated, soft-deleted, hidden and
// hard-deleted at random places (also below the cursor and the boundary);
// slow writers keep transactions open across the runs' starts, some of
// them inside a BEFORE INSERT trigger after nextval() and before they have
// a transaction id; chunks are forced to roll back and retry (failpoint
// batch.chunk_error: PostgreSQL raises a serialization failure the
// batcher's own classifier retries); processes are SIGKILLed at failpoints
// and at random moments; while changes go on, the full job often changes
// its processor version, so that every row must be written again by the
// next run. Each iteration runs one full process and, meanwhile,
// incremental processes one after another (short runs, which pass a slow
// writer's change_seq before it commits unless they waited for it).
//
// The model is the source table itself, read by the test (never the
// product's batch_runs for what must hold):
//   - every full run that succeeded (partition and sweep) holds at its
//     boundary: each row of a snapshot read before the run was created is
//     normalized under the run's processor version at that version or a
//     later one, and rows that were hidden or hard-deleted are tombstones;
//   - the incremental job holds at the change_seq values the test read:
//     before an incremental process starts after one that exited 0, the
//     test reads every row's change_seq; the run the next process to exit
//     0 finished was created after that read, so each row whose change_seq
//     is at or below the highest one of the read still in the table is
//     normalized at its version;
//   - no two events for one (row, version, processor version), and every
//     normalized row has its event;
//   - once the changes stop, runs go on (still under chaos, while new rows
//     arrive) until three of each job that started after the last change
//     have succeeded: the full job's normalized_records then equals the
//     model exactly (late rows may be there or not); then, with every
//     writer stopped, a clean process of each job and one more clean
//     incremental process, started after the test read the source, and
//     the incremental job's normalized_records equals that read exactly;
//   - the chaos happened, as the processes' exit status and stderr tell:
//     every SIGKILL was a planned one, each history has at least one kill
//     at a failpoint, one batch.chunk_error that fired and was retried as
//     a serialization failure (SQLSTATE 40001) by the batcher, and one
//     partition or sweep a killed process held that a later process
//     claimed again (a higher attempt) and finished. The plan of each
//     history's first iteration guarantees one of each.
//
// It prints a master seed and each history's seed; set
// OUTBOXRELAY_RANDOM_SEED to replay one history's choices (the timing of
// the processes still varies).
func TestRandomizedRunsMatchTheModel(t *testing.T) {
	t.Parallel()
	chaosFor := envDuration(t, randomDurationEnv, 10*time.Second)
	budget := envDuration(t, randomBudgetEnv, 150*time.Second)
	began := time.Now()
	bin := testproc.Build(t, "batcher")
	t.Logf("%s: the batcher built", time.Since(began).Round(time.Second))
	if v := os.Getenv(randomSeedEnv); v != "" {
		seed, err := strconv.ParseUint(v, 10, 64)
		require.NoError(t, err, randomSeedEnv)
		t.Logf("replaying the history of seed %d", seed)
		randomHistory(t, bin, seed, chaosFor)
		return
	}
	master := uint64(time.Now().UnixNano())
	t.Logf("master seed %d; histories start while %s (%s) is not spent, each with its own seed", master, budget, randomBudgetEnv)
	seeds := rand.New(rand.NewPCG(master, 0))
	var total chaosCounts
	start := time.Now()
	for h := 1; ; h++ {
		seed := seeds.Uint64()
		t.Logf("history %d: seed %d (replay just it with %s=%d)", h, seed, randomSeedEnv, seed)
		hb := time.Now()
		var c chaosCounts
		if !t.Run(fmt.Sprintf("history%d", h), func(t *testing.T) { c = randomHistory(t, bin, seed, chaosFor) }) {
			t.Fatalf("history %d failed: replay just it with %s=%d", h, randomSeedEnv, seed)
		}
		total.add(c)
		took := time.Since(hb)
		// Another history only if one as long as this one ends within the budget.
		if time.Since(start)+took > budget {
			t.Logf("%s: %d histories (%s); in all %s", time.Since(began).Round(time.Second), h, budget, total)
			return
		}
	}
}

func envDuration(t *testing.T, name string, def time.Duration) time.Duration {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	d, err := time.ParseDuration(v)
	require.NoError(t, err, name)
	return d
}

// randomHistory runs one history from seed and returns what its chaos
// did (each kind at least once, or it fails).
func randomHistory(t *testing.T, bin string, seed uint64, chaosFor time.Duration) chaosCounts {
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("FAILED with seed %d: replay with %s=%d", seed, randomSeedEnv, seed)
		}
	})
	began := time.Now()
	rng := rand.New(rand.NewPCG(seed, 1))
	ctx := context.Background()
	url, pool := newDB(t)
	_, err := pool.Exec(ctx, randSchema)
	require.NoError(t, err)

	fullSize, incrSize := 5+rng.IntN(16), 5+rng.IntN(25)
	m := &mutator{pool: pool, rng: rand.New(rand.NewPCG(seed, 2)), ahead: fullSize}
	require.NoError(t, m.insert(ctx, 400+rng.IntN(400), false))

	errs := batch.ErrorPolicy{Policy: batch.PolicyStrict, MaxRetries: 10, InitialBackoff: batch.Duration(100 * time.Millisecond), MaxBackoff: batch.Duration(400 * time.Millisecond)}
	doc := batch.Document{Fields: []batch.Field{{Name: "id"}, {Name: "title", Transforms: []string{"trim"}}}}
	full := &randJob{name: randFull, spec: batch.Spec{
		Job: randFull, ProcessorVersion: "v1", SourceName: randFull, AggregateType: randFull,
		Source: batch.Source{Table: "rand_records", Cursor: []string{"id"}, ID: "id", Version: "version", Deleted: "deleted",
			Filter: []batch.Condition{{Column: "hidden", Op: "=", Value: "false"}}},
		Document: doc,
		// Pipelined: the ranges of the chunks after the first are planned
		// before they run, and rows arrive inside them.
		Chunk:    batch.ChunkSettings{Size: fullSize, Min: fullSize, Max: fullSize, Pipeline: 2 + rng.IntN(2), LockTimeout: batch.Duration(time.Second)},
		Errors:   errs,
		Vanished: batch.VanishedDelete,
	}}
	incr := &randJob{name: randIncr, spec: batch.Spec{
		Job: randIncr, Mode: batch.ModeIncremental, ProcessorVersion: "v1", SourceName: randIncr, AggregateType: randIncr,
		Source:   batch.Source{Table: "rand_records", Cursor: []string{"change_seq"}, ID: "id", Version: "version", Deleted: "deleted"},
		Document: doc,
		Chunk:    batch.ChunkSettings{Size: incrSize, Min: incrSize, Max: incrSize, Pipeline: 1 + rng.IntN(3), LockTimeout: batch.Duration(time.Second)},
		Errors:   errs,
		Vanished: batch.VanishedKeep,
	}}
	t.Logf("full job: chunk size %d, pipeline %d; incremental job: chunk size %d, pipeline %d",
		fullSize, full.spec.Chunk.Pipeline, incrSize, incr.spec.Chunk.Pipeline)

	chaos := &chaos{}
	// The incremental processes run one after another; cover tracks what
	// the last one that exited 0 must have brought the job to.
	var cover incrCover
	runIncr := func(ip randProcess) error {
		if cover.pending == nil {
			s, err := readSeqs(ctx, pool)
			if err != nil {
				return err
			}
			cover.pending = &s
		}
		killed, err := ip.run(t, bin, url, incr.file(t), chaos)
		if err == nil && !killed {
			cover.covered, cover.pending = cover.pending, nil
		}
		return err
	}

	// One iteration: a process of each job at once, under chaos; then the
	// checks of every run that succeeded meanwhile. The first one's plan
	// guarantees a kill at a failpoint (the full process, at its first
	// chunk; the next full process resumes its run) and a forced retry
	// (the first incremental process, whose run has hundreds of rows).
	var snaps []randSnap
	checkedFull := map[string]bool{}
	processes := 0
	first := true
	iterate := func(final bool) {
		t.Helper()
		fp := full.plan(rng, final)
		// Incremental processes one after another while the full one
		// runs: short runs, which pass a slow writer's change_seq before
		// it commits unless they waited for it.
		ips := make([]randProcess, 8)
		for i := range ips {
			ips[i] = incr.plan(rng, final)
		}
		if first {
			first = false
			fp = randProcess{job: randFull, fp: []string{"batch.after_upsert@1"}, kill: "batch.after_upsert", mustKill: true}
			ips[0] = randProcess{job: randIncr, fp: []string{"batch.chunk_error@1", "batch.chunk_error@3"}, mustRetry: true}
		}
		pv := full.nextPV(t, pool, rng, !final)
		snap := readSnap(t, pool)
		snaps = append(snaps, snap)
		specFile := writeSpec(t, full.withPV(pv))
		var wg sync.WaitGroup
		var ferr, ierr error
		fullDone := make(chan struct{})
		wg.Add(2)
		go func() {
			defer wg.Done()
			defer close(fullDone)
			_, ferr = fp.run(t, bin, url, specFile, chaos)
		}()
		var nIncr int
		go func() {
			defer wg.Done()
			for _, ip := range ips {
				nIncr++
				if ierr = runIncr(ip); ierr != nil {
					return
				}
				select {
				case <-fullDone:
					return
				default:
				}
			}
		}()
		wg.Wait()
		processes += 1 + nIncr
		require.NoError(t, errors.Join(ferr, ierr))
		checkFullRuns(t, pool, snaps, checkedFull)
		checkIncrRuns(t, pool, cover.covered)
		checkEvents(t, pool)
	}

	// Chaos: changes everywhere while runs come and go.
	t.Logf("%s: set up", time.Since(began).Round(time.Second))
	mctx, stopChanges := context.WithCancel(ctx)
	changes := m.run(mctx, false)
	// Two slow writers: a run start often finds one inside its trigger.
	slow, slow2 := m.slowWriter(mctx, false), m.slowWriter(mctx, false)
	t.Cleanup(stopChanges)
	for deadline := time.Now().Add(chaosFor); first || time.Now().Before(deadline); {
		iterate(false)
	}
	stopChanges()
	require.NoError(t, <-changes)
	require.NoError(t, <-slow)
	require.NoError(t, <-slow2)
	quiet := readSnap(t, pool)
	t.Logf("%s: changes stopped after %d processes", time.Since(began).Round(time.Second), processes)

	// Then only new rows arrive (many of them right ahead of the running
	// cursor, inside the ranges of chunks in flight, some from slow
	// writers), and the runs go on until three of each job created after
	// the last change succeeded (batch_runs only says when to stop: what
	// must hold is checked from the test's own reads).
	lctx, stopLate := context.WithCancel(ctx)
	late := m.run(lctx, true)
	lateSlow := m.slowWriter(lctx, true)
	t.Cleanup(stopLate)
	for i := 0; ; i++ {
		nf := queryInt(t, pool, `SELECT count(*) FROM (SELECT 1 FROM batch_runs r JOIN batch_sweeps w USING (job, logical_run_id) WHERE r.job = $1 AND w.state = 'succeeded'
GROUP BY logical_run_id HAVING bool_and(r.state = 'succeeded') AND min(r.created_at) > $2) x`, randFull, quiet.at)
		ni := queryInt(t, pool, `SELECT count(*) FROM batch_runs WHERE job = $1 AND state = 'succeeded' AND created_at > $2`, randIncr, quiet.at)
		if nf >= 3 && ni >= 3 {
			break
		}
		require.Less(t, i, 40, "three runs of each job started after the changes stopped have not succeeded (full %d, incremental %d)", nf, ni)
		iterate(true)
	}
	stopLate()
	require.NoError(t, <-late)
	require.NoError(t, <-lateSlow)

	// Every writer stopped. A clean process of each job finishes what a
	// killed one left; the test reads the source, the final model; then a
	// last clean incremental process, which starts after that read and
	// after one that exited 0, so its run covers every row of it.
	_, err = randProcess{job: randFull}.run(t, bin, url, writeSpec(t, full.withPV(full.nextPV(t, pool, rng, false))), chaos)
	require.NoError(t, err)
	require.NoError(t, runIncr(randProcess{job: randIncr}))
	end := readSnap(t, pool)
	require.NoError(t, runIncr(randProcess{job: randIncr}))
	require.NotNil(t, cover.covered)
	require.False(t, cover.covered.at.Before(end.at), "the last incremental process exited 0 but its run started before the final read of the source")
	processes += 3

	checkFinal(t, pool, quiet, end)
	counts := chaos.finish(t, pool)
	t.Logf("%s: %d processes, %d full runs (%d processor versions), %d incremental runs, %d chunk retries, %d sweep tombstones, %d rows (%d late, %d hidden, %d deleted, %d hard-deleted); chaos: %s",
		time.Since(began).Round(time.Second), processes,
		queryInt(t, pool, `SELECT count(DISTINCT logical_run_id) FROM batch_runs WHERE job = $1`, randFull), full.pvs,
		queryInt(t, pool, `SELECT count(DISTINCT logical_run_id) FROM batch_runs WHERE job = $1`, randIncr),
		queryInt(t, pool, `SELECT COALESCE(sum(retries), 0) FROM batch_runs`),
		queryInt(t, pool, `SELECT COALESCE(sum(deleted_count), 0) FROM batch_sweeps`),
		queryInt(t, pool, `SELECT count(*) FROM rand_records`), queryInt(t, pool, `SELECT count(*) FROM rand_records WHERE late`),
		queryInt(t, pool, `SELECT count(*) FROM rand_records WHERE hidden`), queryInt(t, pool, `SELECT count(*) FROM rand_records WHERE deleted`),
		queryInt(t, pool, `SELECT count(*) FROM rand_graveyard`), counts)
	require.Positive(t, counts.FailpointKills, "no process of this history died at a failpoint (the failpoints do not kill?)")
	require.Positive(t, counts.Injected, "no batch.chunk_error failpoint fired")
	require.Positive(t, counts.Retried, "no chunk was retried after an injected serialization failure")
	require.Positive(t, counts.Resumed, "no partition or sweep of a killed process was claimed again and finished by a later process")
	return counts
}

// randJob is one of the test's two jobs.
type randJob struct {
	name string
	spec batch.Spec
	pvs  int // processor versions the full job went through
	path string
}

func (j *randJob) file(t *testing.T) string {
	if j.path == "" {
		j.path = writeSpec(t, j.spec)
	}
	return j.path
}

func (j *randJob) withPV(pv string) batch.Spec {
	s := j.spec
	s.ProcessorVersion = pv
	return s
}

// nextPV is the processor version of the full job's next process: the
// newest run's while it is not over (a checkpoint is not resumed under
// another version), else, when change is set, a new one half of the
// time, so the next run must write every row again (a row it skips stays
// at the old version).
func (j *randJob) nextPV(t *testing.T, pool *pgxpool.Pool, rng *rand.Rand, change bool) string {
	t.Helper()
	var pv string
	var done bool
	err := pool.QueryRow(context.Background(), `
SELECT r.processor_version, bool_and(r.state = 'succeeded') AND COALESCE(bool_and(w.state = 'succeeded'), true)
FROM batch_runs r LEFT JOIN batch_sweeps w USING (job, logical_run_id)
WHERE r.job = $1 GROUP BY r.logical_run_id, r.processor_version ORDER BY max(r.created_at) DESC LIMIT 1`, j.name).Scan(&pv, &done)
	if errors.Is(err, pgx.ErrNoRows) {
		j.pvs = 1
		return "v1"
	}
	require.NoError(t, err)
	if done && rng.IntN(2) == 0 && change {
		j.pvs++
		return "v" + strconv.Itoa(j.pvs)
	}
	return pv
}

// randProcess is the plan of one batcher process: its failpoints, or a
// SIGKILL after a random time.
type randProcess struct {
	job       string
	fp        []string
	kill      string // the failpoint planned to kill it (reached or not), or ""
	killAfter time.Duration
	mustKill  bool // the kill at the failpoint must happen (the plan guarantees it is reached)
	mustRetry bool // a batch.chunk_error must fire and be retried (the plan guarantees it is reached)
	// inFlight is how many chunks of a partition run at once (the job's
	// chunk.pipeline): as many injected errors may be waiting for their
	// retry when a kill lands.
	inFlight int
}

// plan draws a process: clean, with forced chunk retries (often, and
// always in the final phase: rows arrive inside the planned ranges while
// the chunk backs off), killed at a failpoint, or killed at a random moment.
func (j *randJob) plan(rng *rand.Rand, final bool) randProcess {
	p := randProcess{job: j.name, inFlight: max(j.spec.Chunk.Pipeline, 1)}
	retries := func(n, upTo int) {
		for range n {
			p.fp = append(p.fp, fmt.Sprintf("batch.chunk_error@%d", 1+rng.IntN(upTo)))
		}
	}
	if final {
		retries(3, 30)
	}
	points := []string{"batch.before_tx", "batch.after_upsert", "batch.after_checkpoint", "batch.after_commit", "batch.sweep_after_delete", "batch.sweep_after_commit"}
	if j.spec.Mode == batch.ModeIncremental {
		points = points[:4] // no sweep
	}
	switch rng.IntN(5) {
	case 0: // a clean process
	case 1, 2:
		retries(2+rng.IntN(4), 40)
	case 3:
		p.kill = points[rng.IntN(len(points))]
		p.fp = append(p.fp, fmt.Sprintf("%s@%d", p.kill, 1+rng.IntN(8)))
		retries(rng.IntN(3), 10)
	case 4:
		p.killAfter = time.Duration(50+rng.IntN(1500)) * time.Millisecond
		retries(rng.IntN(3), 10)
	}
	return p
}

// run runs the process to its end and reports whether it was killed; a
// process that was not killed must exit 0. What its chaos did is added to
// c (an error if it is not what the plan allows).
func (p randProcess) run(t *testing.T, bin, url, specFile string, c *chaos) (killed bool, err error) {
	proc := testproc.Start(t, bin, env(url, failpoint.EnvVar+"="+strings.Join(p.fp, ","), crashLease), "run", "--spec", specFile)
	signaled := false
	if p.killAfter > 0 {
		select {
		case <-proc.Done():
		case <-time.After(p.killAfter): // a kill at a random moment
			signaled = proc.Signal(syscall.SIGKILL) == nil
		}
	}
	if err := proc.Wait(2 * time.Minute); err != nil && !proc.Killed() && proc.ExitCode() < 0 {
		return false, fmt.Errorf("%s: batcher did not end: %w\nstderr:\n%s", p.job, err, proc.Stderr())
	}
	if !proc.Killed() && proc.ExitCode() != 0 {
		return false, fmt.Errorf("%s: batcher exited %d (failpoints %v); stderr:\n%s", p.job, proc.ExitCode(), p.fp, proc.Stderr())
	}
	if err := c.add(p, proc.Stderr(), proc.Killed(), signaled); err != nil {
		return proc.Killed(), fmt.Errorf("%s (failpoints %v, killed %v): %w; stderr:\n%s", p.job, p.fp, proc.Killed(), err, proc.Stderr())
	}
	return proc.Killed(), nil
}

// chaos collects what a history's processes went through, from their exit
// status and stderr (not from the product's tables).
type chaos struct {
	mu sync.Mutex
	chaosCounts
	claims []randClaim // what killed processes had claimed
}

// chaosCounts: how often each kind of chaos happened.
type chaosCounts struct {
	FailpointKills int // processes that died of SIGKILL at their planned failpoint
	TimerKills     int // processes the test SIGKILLed at a random moment
	Unreached      int // planned failpoint kills not reached (the run had fewer chunks; the process exited 0)
	Injected       int // batch.chunk_error failpoints that fired
	Retried        int // chunks the batcher retried after an injected serialization failure (SQLSTATE 40001)
	Resumed        int // partitions and sweeps of killed processes a later process claimed again and finished
}

func (c *chaosCounts) add(o chaosCounts) {
	c.FailpointKills += o.FailpointKills
	c.TimerKills += o.TimerKills
	c.Unreached += o.Unreached
	c.Injected += o.Injected
	c.Retried += o.Retried
	c.Resumed += o.Resumed
}

func (c chaosCounts) String() string {
	return fmt.Sprintf("%d kills at failpoints (%d planned ones not reached), %d kills at random moments, %d chunk errors injected, %d retried as serialization failures, %d claims of killed processes resumed",
		c.FailpointKills, c.Unreached, c.TimerKills, c.Injected, c.Retried, c.Resumed)
}

// randClaim is a partition ("partition claimed") or sweep ("sweep
// claimed") a process claimed, as its log says.
type randClaim struct {
	job, run, partition string
	sweep               bool
	attempt             int
}

// add reads one process's stderr: the failpoints' own lines ("failpoint
// NAME: killing process", "failpoint batch.chunk_error: injecting an
// error") and the batcher's JSON log (retries, claims).
func (c *chaos) add(p randProcess, stderr string, killed, signaled bool) error {
	var (
		problems          []string
		injected, retried int
		atFailpoint       bool
		claims            []randClaim
	)
	for _, line := range strings.Split(stderr, "\n") {
		switch {
		case line == "failpoint batch.chunk_error: injecting an error":
			injected++
		case strings.HasPrefix(line, "failpoint ") && strings.Contains(line, ": killing process"):
			if p.kill == "" || !strings.HasPrefix(line, "failpoint "+p.kill+": ") {
				problems = append(problems, "an unplanned failpoint kill: "+line)
			}
			atFailpoint = true
		case strings.HasPrefix(line, "{"):
			var e struct {
				Msg, Reason, Error, Job, Run, Partition string
				Attempt                                 int
			}
			if json.Unmarshal([]byte(line), &e) != nil {
				continue
			}
			switch e.Msg {
			case "chunk rolled back; retrying":
				if !strings.Contains(e.Error, "injected at batch.chunk_error") {
					continue // a real conflict with the test's writers
				}
				if e.Reason != "transient" || !strings.Contains(e.Error, "(SQLSTATE 40001)") {
					problems = append(problems, fmt.Sprintf("an injected chunk error retried with reason %q, error %q: want a serialization failure (SQLSTATE 40001), reason transient", e.Reason, e.Error))
				}
				retried++
			case "partition claimed", "sweep claimed":
				claims = append(claims, randClaim{job: e.Job, run: e.Run, partition: e.Partition, sweep: e.Msg == "sweep claimed", attempt: e.Attempt})
			}
		}
	}
	switch {
	case killed && !atFailpoint && !signaled:
		problems = append(problems, "died of SIGKILL, neither at its planned failpoint nor by the test")
	case atFailpoint && !killed:
		problems = append(problems, "its failpoint said it kills the process, which did not die of SIGKILL")
	case p.mustKill && !atFailpoint:
		problems = append(problems, fmt.Sprintf("the planned kill at %s did not happen", p.kill))
	}
	// Every injected error is retried; a kill may come between the two,
	// for each chunk in flight (with pipelining, several chunks can have
	// failed and be about to log their retry when a pipelined one reaches
	// the kill: seen in a CI run, 2 injected, 0 retried, pipeline 3).
	if retried > injected || retried < injected-p.inFlight || (retried < injected && !killed) {
		problems = append(problems, fmt.Sprintf("%d chunk errors injected, %d retried", injected, retried))
	}
	if p.mustRetry && (injected == 0 || retried == 0) {
		problems = append(problems, fmt.Sprintf("the planned batch.chunk_error did not fire and get retried (%d injected, %d retried)", injected, retried))
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case killed && atFailpoint:
		c.FailpointKills++
	case killed:
		c.TimerKills++
	}
	if p.kill != "" && !atFailpoint {
		c.Unreached++
	}
	c.Injected += injected
	c.Retried += retried
	if killed {
		c.claims = append(c.claims, claims...)
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

// finish checks, once the last clean processes ended, that every partition
// and sweep a killed process had claimed is finished, and counts those a
// later process claimed again (a higher attempt).
func (c *chaos) finish(t *testing.T, pool *pgxpool.Pool) chaosCounts {
	t.Helper()
	for _, cl := range c.claims {
		var state string
		var attempt int
		var err error
		if cl.sweep {
			err = pool.QueryRow(context.Background(), `SELECT state, attempt FROM batch_sweeps WHERE job = $1 AND logical_run_id = $2`, cl.job, cl.run).Scan(&state, &attempt)
		} else {
			err = pool.QueryRow(context.Background(), `SELECT state, attempt FROM batch_runs WHERE job = $1 AND logical_run_id = $2 AND partition_key = $3`, cl.job, cl.run, cl.partition).Scan(&state, &attempt)
		}
		require.NoError(t, err, "%+v", cl)
		require.Equal(t, "succeeded", state, "a killed process had claimed %+v; after the last clean processes it is not finished", cl)
		if attempt > cl.attempt {
			c.Resumed++
		}
	}
	return c.chaosCounts
}

// seqSnap is every row's change_seq, read in one snapshot at `at` (the
// server's clock, after the snapshot was taken).
type seqSnap struct {
	at  time.Time
	ids []string
	seq []int64
}

func readSeqs(ctx context.Context, pool *pgxpool.Pool) (seqSnap, error) {
	var s seqSnap
	err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&s.at); err != nil {
			return err
		}
		return tx.QueryRow(ctx, `SELECT COALESCE(array_agg(id), '{}'), COALESCE(array_agg(change_seq), '{}') FROM rand_records`).Scan(&s.ids, &s.seq)
	})
	return s, err
}

// incrCover: what the incremental job must hold. pending is the test's
// read before the first incremental process after the last one that
// exited 0; covered is the read an exited-0 process covers (its run was
// created after it: it was the unfinished run then or created later).
type incrCover struct {
	pending, covered *seqSnap
}

// readSnap reads the source in one snapshot.
func readSnap(t *testing.T, pool *pgxpool.Pool) randSnap {
	t.Helper()
	ctx := context.Background()
	s := randSnap{rows: map[string]randRow{}, gone: map[string]bool{}}
	err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		// The snapshot is taken at the first statement; the clock is read
		// after it, so every row it sees committed before s.at.
		if err := tx.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&s.at); err != nil {
			return err
		}
		rows, _ := tx.Query(ctx, `SELECT id, version, deleted, hidden, title FROM rand_records`)
		var (
			id string
			r  randRow
		)
		if _, err := pgx.ForEachRow(rows, []any{&id, &r.version, &r.deleted, &r.hidden, &r.title}, func() error { s.rows[id] = r; return nil }); err != nil {
			return err
		}
		rows, _ = tx.Query(ctx, `SELECT id FROM rand_graveyard`)
		_, err := pgx.ForEachRow(rows, []any{&id}, func() error { s.gone[id] = true; return nil })
		return err
	})
	require.NoError(t, err)
	return s
}

// normRow is a normalized_records row.
type normRow struct {
	version  int64
	deleted  bool
	pv       string
	docID    *string
	docTitle *string
}

func readNormalized(t *testing.T, pool *pgxpool.Pool, source string) map[string]normRow {
	t.Helper()
	out := map[string]normRow{}
	rows, err := pool.Query(context.Background(), `SELECT source_id, source_version, deleted, processor_version, document->>'id', document->>'title' FROM normalized_records WHERE source = $1`, source)
	require.NoError(t, err)
	var (
		id string
		n  normRow
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &n.version, &n.deleted, &n.pv, &n.docID, &n.docTitle}, func() error { out[id] = n; return nil })
	require.NoError(t, err)
	return out
}

// matches says what is wrong with n as the normalized form of r at r's
// version, or "".
func matches(id string, n normRow, r randRow) string {
	switch {
	case n.deleted != r.deleted:
		return fmt.Sprintf("row %s version %d: normalized deleted %v, source deleted %v", id, r.version, n.deleted, r.deleted)
	case !r.deleted && (n.docID == nil || *n.docID != id || n.docTitle == nil || *n.docTitle != strings.TrimSpace(r.title)):
		return fmt.Sprintf("row %s version %d: document id %v title %v, want %q", id, r.version, deref(n.docID), deref(n.docTitle), strings.TrimSpace(r.title))
	}
	return ""
}

// checkFullRuns checks every full run that succeeded since the last call
// against the snapshot read last before it was created: each visible row
// of it normalized under the run's processor version at its version (or,
// changed since, a later one) or, if it left the scope since, maybe a
// tombstone; each row hidden or hard-deleted then a tombstone of the
// run's version, or never normalized.
func checkFullRuns(t *testing.T, pool *pgxpool.Pool, snaps []randSnap, checked map[string]bool) {
	t.Helper()
	type run struct {
		ID, PV  string
		Created time.Time
	}
	rows, err := pool.Query(context.Background(), `
SELECT r.logical_run_id, min(r.processor_version), min(r.created_at) FROM batch_runs r JOIN batch_sweeps w USING (job, logical_run_id)
WHERE r.job = $1 AND w.state = 'succeeded' GROUP BY r.logical_run_id HAVING bool_and(r.state = 'succeeded') ORDER BY 3`, randFull)
	require.NoError(t, err)
	runs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[run])
	require.NoError(t, err)
	for _, r := range runs {
		if checked[r.ID] {
			continue
		}
		checked[r.ID] = true
		i := slices.IndexFunc(snaps, func(s randSnap) bool { return !s.at.Before(r.Created) }) - 1
		if i == -2 {
			i = len(snaps) - 1
		}
		require.GreaterOrEqual(t, i, 0, "run %s created at %s before the first snapshot", r.ID, r.Created)
		now := readSnap(t, pool)
		problems := fullProblems(snaps[i], now, readNormalized(t, pool, randFull), r.PV, false)
		requireNoProblems(t, problems, "full run %s (processor version %s) succeeded but normalized_records does not hold the rows of the snapshot of %s, before it started",
			r.ID, r.PV, snaps[i].at.Format(time.RFC3339Nano))
	}
}

// fullProblems compares the full job's normalized rows with a snapshot
// (and, for rows that left the scope after it, the source now). exact: no
// change happened since the snapshot but new rows (late), which may or
// may not be normalized yet.
func fullProblems(snap, now randSnap, norm map[string]normRow, pv string, exact bool) []string {
	var problems []string
	left := func(id string) bool {
		r, ok := now.rows[id]
		return now.gone[id] || (ok && r.hidden)
	}
	isTombstone := func(id string) bool {
		n, ok := norm[id]
		return !ok || (n.deleted && n.pv == pv)
	}
	tombstone := func(id string) {
		if n := norm[id]; !isTombstone(id) {
			problems = append(problems, fmt.Sprintf("row %s left the scope: normalized deleted %v processor version %s, want a tombstone of %s", id, n.deleted, n.pv, pv))
		}
	}
	for id, r := range snap.rows {
		n, ok := norm[id]
		switch {
		case r.hidden:
			tombstone(id)
		case left(id) && isTombstone(id):
			// It left after the snapshot, before the run read it.
		case !ok:
			problems = append(problems, fmt.Sprintf("row %s (version %d) never normalized", id, r.version))
		case n.pv != pv:
			problems = append(problems, fmt.Sprintf("row %s (version %d): normalized under processor version %s at version %d, want %s", id, r.version, n.pv, n.version, pv))
		case n.version < r.version || (exact && n.version != r.version):
			problems = append(problems, fmt.Sprintf("row %s: normalized at version %d, source had %d", id, n.version, r.version))
		case n.version == r.version:
			if p := matches(id, n, r); p != "" {
				problems = append(problems, p)
			}
		}
	}
	for id := range snap.gone {
		tombstone(id)
	}
	if exact {
		for id, n := range norm {
			if _, ok := snap.rows[id]; ok || snap.gone[id] {
				continue
			}
			problems = append(problems, lateProblem(id, n, now)...)
		}
	}
	return problems
}

// lateProblem checks a normalized row that is not in the final model: it
// must be a late row (inserted after the changes stopped) at version 1.
func lateProblem(id string, n normRow, now randSnap) []string {
	r, ok := now.rows[id]
	switch {
	case !ok:
		return []string{fmt.Sprintf("normalized row %s is not in the source", id)}
	case n.version != 1:
		return []string{fmt.Sprintf("late row %s normalized at version %d", id, n.version)}
	}
	if p := matches(id, n, r); p != "" {
		return []string{p}
	}
	return nil
}

// checkIncrRuns checks the incremental job at what the test read before
// the run the last exited-0 process finished was created: each row of
// that read still in the table with the same change_seq was there when
// the run read its boundary, so the boundary is at or above the highest
// of them, and every row whose change_seq is at or below it (a change
// gives a row a new, higher one) is normalized at its version.
func checkIncrRuns(t *testing.T, pool *pgxpool.Pool, covered *seqSnap) {
	t.Helper()
	if covered == nil {
		return
	}
	b := queryInt(t, pool, `SELECT COALESCE(max(c.seq), 0) FROM unnest($1::text[], $2::bigint[]) c(id, seq) JOIN rand_records s ON s.id = c.id AND s.change_seq = c.seq`, covered.ids, covered.seq)
	requireNoProblems(t, incrProblems(t, pool, b), "an incremental process exited 0 after the test read the source at %s: every row at or below change_seq %d (the highest of that read still unchanged) must be normalized at its version",
		covered.at.Format(time.RFC3339Nano), b)
}
func incrProblems(t *testing.T, pool *pgxpool.Pool, boundary int64) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `
SELECT s.id, s.version, s.deleted, s.title, s.change_seq, n.source_version, n.deleted, n.document->>'id', n.document->>'title'
FROM rand_records s LEFT JOIN normalized_records n ON n.source = $1 AND n.source_id = s.id
WHERE s.change_seq <= $2`, randIncr, boundary)
	require.NoError(t, err)
	var (
		problems []string
		id       string
		r        randRow
		seq      int64
		nv       *int64
		nd       *bool
		n        normRow
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &r.version, &r.deleted, &r.title, &seq, &nv, &nd, &n.docID, &n.docTitle}, func() error {
		switch {
		case nv == nil:
			problems = append(problems, fmt.Sprintf("row %s (version %d, change_seq %d) never normalized", id, r.version, seq))
		case *nv != r.version:
			problems = append(problems, fmt.Sprintf("row %s (change_seq %d): normalized at version %d, source has %d", id, seq, *nv, r.version))
		default:
			n.version, n.deleted = *nv, *nd
			if p := matches(id, n, r); p != "" {
				problems = append(problems, p)
			}
		}
		return nil
	})
	require.NoError(t, err)
	return problems
}

// checkEvents: one event per (row, version, processor version) of each
// job, and one for every normalized row's version and processor version,
// a delete for a deleted row.
func checkEvents(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	pvh := outbox.HeaderProcessorVersion
	dups := queryInt(t, pool, `SELECT count(*) FROM (SELECT 1 FROM outbox_event_members GROUP BY aggregate_type, aggregate_id, aggregate_version, headers->>$1 HAVING count(*) > 1) d`, pvh)
	require.Zero(t, dups, "(row, version, processor version) with more than one event")
	missing := queryInt(t, pool, `SELECT count(*) FROM normalized_records n WHERE NOT EXISTS (
  SELECT 1 FROM outbox_event_members e WHERE e.aggregate_type = n.source AND e.aggregate_id = n.source_id AND e.aggregate_version = n.source_version
    AND e.headers->>$1 = n.processor_version AND (e.event_type = 'delete') = n.deleted)`, pvh)
	require.Zero(t, missing, "normalized rows without their event (same version, processor version and kind)")
}

// checkFinal: after three runs of each job that started after the last
// change, normalized_records equals the model.
// checkFinal: after three runs of each job that started after the last
// change, the full job's normalized_records equals the model (the source
// when the changes stopped; late rows may be there or not). After the last
// clean incremental process, which started after the test read end with
// every writer stopped, the incremental job's equals end: every row at its
// version, and no other row but hard-deleted ones (an incremental run does
// not see hard deletes).
func checkFinal(t *testing.T, pool *pgxpool.Pool, model, end randSnap) {
	t.Helper()
	var pv string
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT processor_version FROM batch_runs WHERE job = $1 ORDER BY created_at DESC LIMIT 1`, randFull).Scan(&pv))
	now := readSnap(t, pool)
	requireNoProblems(t, fullProblems(model, now, readNormalized(t, pool, randFull), pv, true), "full job: normalized_records differs from the model")

	var problems []string
	norm := readNormalized(t, pool, randIncr)
	for id, r := range end.rows {
		n, ok := norm[id]
		switch {
		case !ok:
			problems = append(problems, fmt.Sprintf("row %s (version %d) never normalized", id, r.version))
		case n.version != r.version:
			problems = append(problems, fmt.Sprintf("row %s: normalized at version %d, source has %d", id, n.version, r.version))
		default:
			if p := matches(id, n, r); p != "" {
				problems = append(problems, p)
			}
		}
	}
	for id := range norm {
		if _, ok := end.rows[id]; !ok && !end.gone[id] {
			problems = append(problems, fmt.Sprintf("normalized row %s is not in the source", id))
		}
	}
	for id, r := range model.rows {
		if _, ok := end.rows[id]; !ok {
			problems = append(problems, fmt.Sprintf("row %s (version %d) of the model is gone from the source", id, r.version))
		}
	}
	requireNoProblems(t, problems, "incremental job: normalized_records differs from the source read before the last clean incremental process")
	checkEvents(t, pool)
}

func requireNoProblems(t *testing.T, problems []string, msg string, args ...any) {
	t.Helper()
	if len(problems) == 0 {
		return
	}
	slices.Sort(problems)
	n := len(problems)
	if n > 10 {
		problems = append(problems[:10], fmt.Sprintf("... and %d more", n-10))
	}
	t.Fatalf("%s (%d problems):\n%s", fmt.Sprintf(msg, args...), n, strings.Join(problems, "\n"))
}

func deref(s *string) any {
	if s == nil {
		return nil
	}
	return *s
}

// mutator changes rand_records at random places: inserts with random text
// keys (some right ahead of the full job's running cursor), title updates,
// soft deletes, filter leaves (hidden) and hard deletes of random rows, in
// short transactions that sometimes stay open a moment.
type mutator struct {
	pool  *pgxpool.Pool
	ahead int // how far ahead of the running cursor to insert, in rows
	mu    sync.Mutex
	rng   *rand.Rand
}

func (m *mutator) intN(n int) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.rng.IntN(n)
}

func (m *mutator) key() string {
	const letters = "abcdefghijklmnopqrstuvwxyz0123456789"
	m.mu.Lock()
	defer m.mu.Unlock()
	b := make([]byte, 10)
	for i := range b {
		b[i] = letters[m.rng.IntN(len(letters))]
	}
	return string(b)
}

func (m *mutator) insert(ctx context.Context, n int, late bool) error {
	ids := make([]string, n)
	titles := make([]string, n)
	for i := range ids {
		ids[i], titles[i] = m.key(), fmt.Sprintf("  title %d  ", m.intN(1_000_000))
	}
	_, err := m.pool.Exec(ctx, `INSERT INTO rand_records (id, title, late) SELECT * , $3::boolean FROM unnest($1::text[], $2::text[]) ON CONFLICT DO NOTHING`, ids, titles, late)
	return err
}

// The mutator's operations; opsChaos weighs them.
const (
	opInsert = iota
	opUpdate
	opSoftDelete
	opInsertAhead
	opHide
	opHardDelete
)

var opsChaos = []int{opInsert, opInsert, opUpdate, opUpdate, opUpdate, opSoftDelete, opInsertAhead, opInsertAhead, opInsertAhead, opHide, opHardDelete}

// run changes rows until ctx ends (only inserts of late rows when late is
// set) and sends the first error, or nil, once it stopped.
func (m *mutator) run(ctx context.Context, late bool) <-chan error {
	done := make(chan error, 1)
	go func() {
		for ctx.Err() == nil {
			op := opsChaos[m.intN(len(opsChaos))]
			if late {
				op = []int{opInsert, opInsertAhead}[m.intN(2)]
			}
			at := m.key() // a random place in the key order
			n := 1 + m.intN(5)
			hold := time.Duration(5+m.intN(35)) * time.Millisecond
			if late {
				hold += 80 * time.Millisecond // fewer new rows: the last runs stay short
			}
			err := pgx.BeginFunc(context.WithoutCancel(ctx), m.pool, func(tx pgx.Tx) error {
				var err error
				switch op {
				case opInsert:
					ids := make([]string, n)
					for i := range ids {
						ids[i] = m.key()
					}
					_, err = tx.Exec(ctx, `INSERT INTO rand_records (id, title, late) SELECT u.k, '  new ' || u.k || ' ', $2 FROM unnest($1::text[]) u(k)
WHERE NOT EXISTS (SELECT FROM rand_graveyard g WHERE g.id = u.k) ON CONFLICT DO NOTHING`, ids, late)
				case opUpdate:
					_, err = tx.Exec(ctx, `UPDATE rand_records SET title = '  edited ' || version || ' ' WHERE id IN (SELECT id FROM rand_records WHERE id >= $1 AND NOT late ORDER BY id LIMIT $2)`, at, n)
				case opSoftDelete:
					_, err = tx.Exec(ctx, `UPDATE rand_records SET deleted = true WHERE id IN (SELECT id FROM rand_records WHERE id >= $1 AND NOT late ORDER BY id LIMIT $2)`, at, n)
				case opHide:
					_, err = tx.Exec(ctx, `UPDATE rand_records SET hidden = true WHERE id IN (SELECT id FROM rand_records WHERE id >= $1 AND NOT late ORDER BY id LIMIT $2)`, at, 1+n/3)
				case opHardDelete:
					_, err = tx.Exec(ctx, `DELETE FROM rand_records WHERE id IN (SELECT id FROM rand_records WHERE id >= $1 AND NOT late ORDER BY id LIMIT $2)`, at, 1+n/3)
				case opInsertAhead:
					// Right ahead of the full job's running cursor: inside
					// the ranges of the chunks in flight, and of their
					// retries.
					_, err = tx.Exec(ctx, `INSERT INTO rand_records (id, title, late)
SELECT k, '  next to ' || r.id || ' ', $2
FROM (SELECT id FROM rand_records
      WHERE id > COALESCE((SELECT cursor[1] FROM batch_runs WHERE job = $4 AND state = 'running' ORDER BY created_at DESC LIMIT 1), '')
      ORDER BY id OFFSET $3 LIMIT 1) r, generate_series(1, $1::int) g, LATERAL (SELECT r.id || '~' || lpad(g::text, 2, '0') AS k) x
WHERE NOT EXISTS (SELECT FROM rand_graveyard gy WHERE gy.id = x.k)
ON CONFLICT DO NOTHING`, 3*n, late, m.intN(3*m.ahead), randFull)
				}
				if err == nil && hold > 0 {
					select { // a writer that stays open a moment
					case <-ctx.Done():
					case <-time.After(hold):
					}
				}
				return err
			})
			if err != nil && ctx.Err() == nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	return done
}

// slowWriter keeps a write transaction open most of the time, across the
// runs' starts: its INSERT takes a change_seq and then waits in the slow
// BEFORE INSERT trigger before it has a transaction id, then the
// transaction stays open a while (sometimes with an update of a random
// row too) before it commits. The runs must wait for it: its row's
// change_seq is below the rows committed meanwhile.
func (m *mutator) slowWriter(ctx context.Context, late bool) <-chan error {
	done := make(chan error, 1)
	go func() {
		for ctx.Err() == nil {
			// Half of them wait long in the trigger (no transaction id
			// yet), the others after the INSERT.
			id, slowMS := m.key(), 300+m.intN(1200)
			hold := time.Duration(m.intN(200)) * time.Millisecond
			if m.intN(2) == 0 {
				slowMS, hold = 50+m.intN(200), time.Duration(300+m.intN(1200))*time.Millisecond
			}
			update := !late && m.intN(2) == 0
			at := m.key()
			err := pgx.BeginFunc(context.WithoutCancel(ctx), m.pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `INSERT INTO rand_records (id, title, late, slow_ms) SELECT $1::text, '  slow ' || $1::text || ' ', $2::boolean, $3::int
WHERE NOT EXISTS (SELECT FROM rand_graveyard g WHERE g.id = $1::text) ON CONFLICT DO NOTHING`, id, late, slowMS); err != nil {
					return err
				}
				if update {
					if _, err := tx.Exec(ctx, `UPDATE rand_records SET title = '  slowly edited ' || version || ' ' WHERE id = (SELECT id FROM rand_records WHERE id >= $1 AND NOT late ORDER BY id LIMIT 1)`, at); err != nil {
						return err
					}
				}
				select {
				case <-ctx.Done():
				case <-time.After(hold):
				}
				return nil
			})
			if err != nil && ctx.Err() == nil {
				done <- err
				return
			}
			select { // a short pause: most run starts still find it open
			case <-ctx.Done():
			case <-time.After(time.Duration(m.intN(100)) * time.Millisecond):
			}
		}
		done <- nil
	}()
	return done
}
