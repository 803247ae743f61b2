package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// followPipeline is a pipeline whose job is the demo job in incremental
// mode (cursor change_seq), seeded with rows, with the follow trigger
// installed by `batcher follow-trigger --install`.
func followPipeline(t *testing.T, rows int, o pipelineOptions) *pipeline {
	t.Helper()
	ctx := context.Background()
	p := newPipeline(t, o)
	p.spec.Job = "records-follow"
	p.spec.Mode = batch.ModeIncremental
	p.spec.Source.Cursor = []string{"change_seq"}
	p.spec.Vanished = batch.VanishedKeep
	b, err := json.MarshalIndent(p.spec, "", "  ")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p.specFile, b, 0o644))
	require.NoError(t, demo.Seed(ctx, p.pool, demo.SeedOptions{Rows: rows}))
	tr := testproc.Run(t, time.Minute, p.batcherBin, p.env(), "follow-trigger", "--spec", p.specFile, "--install")
	require.Equal(t, 0, tr.ExitCode(), "follow-trigger --install:\n%s", tr.Stderr())
	return p
}

func (p *pipeline) startFollower(extra ...string) *testproc.Proc {
	return testproc.Start(p.tb, p.batcherBin, p.env(extra...), "run", "--spec", p.specFile, "--follow")
}

// behind counts the source rows whose normalized row is missing or not at
// the row's current version (the model: every source row at its last
// version in normalized_records), over the test's own connection.
func (p *pipeline) behind(ctx context.Context) int64 {
	p.tb.Helper()
	var n int64
	require.NoError(p.tb, p.pool.QueryRow(ctx, `
SELECT count(*) FROM source_records s LEFT JOIN normalized_records n ON n.source = $1 AND n.source_id = s.id::text
WHERE n.source_version IS DISTINCT FROM s.version`, sourceName).Scan(&n))
	return n
}

// waitFollowed waits until normalized_records holds every source row at its
// last version, failing if a follower exits meanwhile.
func (p *pipeline) waitFollowed(ctx context.Context, timeout time.Duration, f *testproc.Proc) {
	p.tb.Helper()
	deadline := time.Now().Add(timeout)
	for {
		n := p.behind(ctx)
		if n == 0 {
			return
		}
		select {
		case <-f.Done():
			p.tb.Fatalf("follower exited (code %d) with %d rows behind:\n%s", f.ExitCode(), n, tail(f.Stderr(), 30))
		default:
		}
		require.Truef(p.tb, time.Now().Before(deadline), "%d source rows behind after %s:\n%s", n, timeout, tail(f.Stderr(), 30))
		pause(ctx, 50*time.Millisecond)
	}
}

// runStates counts the job's partitions per state, over a new connection.
func (p *pipeline) runStates(ctx context.Context) map[string]int {
	p.tb.Helper()
	rows, err := p.pool.Query(ctx, `SELECT state, count(*) FROM batch_runs WHERE job = $1 GROUP BY state`, p.spec.Job)
	require.NoError(p.tb, err)
	out := map[string]int{}
	var state string
	var n int
	_, err = pgx.ForEachRow(rows, []any{&state, &n}, func() error { out[state] = n; return nil })
	require.NoError(p.tb, err)
	return out
}

// writer makes single-row changes at a steady rate until stopped: title
// updates of random rows, now and then a soft delete or a new row.
type writer struct {
	stop    func() int64
	changes int64
}

func (p *pipeline) startWriter(ctx context.Context, perSecond int) *writer {
	p.tb.Helper()
	rows, err := p.pool.Query(ctx, `SELECT id FROM source_records ORDER BY id`)
	require.NoError(p.tb, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(p.tb, err)
	wctx, cancel := context.WithCancel(ctx)
	w := &writer{}
	var wg sync.WaitGroup
	var werr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 17))
		t := time.NewTicker(time.Second / time.Duration(perSecond))
		defer t.Stop()
		for {
			select {
			case <-wctx.Done():
				return
			case <-t.C:
			}
			id := ids[rng.IntN(len(ids))]
			var err error
			switch n := rng.IntN(100); {
			case n == 0:
				_, err = p.pool.Exec(wctx, `UPDATE source_records SET deleted_at = now() WHERE id = $1 AND deleted_at IS NULL`, id)
			case n == 1:
				_, err = p.pool.Exec(wctx, `INSERT INTO source_records (id, tenant_id, payload) SELECT max(id) + 3, 't1', jsonb_build_object('title', 'new ' || (max(id) + 3)) FROM source_records`)
			default:
				_, err = p.pool.Exec(wctx, `UPDATE source_records SET payload = jsonb_set(payload, '{title}', to_jsonb($2::text)) WHERE id = $1`, id, "edit "+strconv.FormatInt(w.changes, 10))
			}
			if err != nil && wctx.Err() == nil {
				werr = err
				return
			}
			w.changes++
		}
	}()
	w.stop = func() int64 {
		cancel()
		wg.Wait()
		require.NoError(p.tb, werr, "writer")
		return w.changes
	}
	return w
}

// Single-row changes at a steady rate reach search through the three real
// binaries, with `batcher run --follow` in place of scheduled runs; once
// the writer stops, the index equals the source.
func TestFollowContinuousChangesReachTheIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := followPipeline(t, 5000, pipelineOptions{TopicPartitions: 3})
	pub := p.startPublisher("LOG_LEVEL=warn")
	ix := p.startIndexer("LOG_LEVEL=warn")
	f := p.startFollower("LOG_LEVEL=warn")
	procs := func() string {
		return "follower:\n" + tail(f.Stderr(), 20) + "\npublisher:\n" + tail(pub.Stderr(), 20) + "\nindexer:\n" + tail(ix.Stderr(), 20)
	}
	p.waitFollowed(ctx, 2*time.Minute, f)

	w := p.startWriter(ctx, 50)
	// While the changes go on, some of them become searchable: wait for
	// the index to hold a document edited by the writer.
	deadline := time.Now().Add(time.Minute)
	for p.editedInIndex(ctx) == 0 {
		require.True(t, time.Now().Before(deadline), "no edit searchable while the writer runs\n%s", procs())
		pause(ctx, 100*time.Millisecond)
	}
	pause(ctx, 8*time.Second) // the writer's window
	changes := w.stop()
	require.Greater(t, changes, int64(200))
	p.waitFollowed(ctx, time.Minute, f)
	s := p.waitSettled(ctx, 2*time.Minute, procs)
	live := p.assertIndexEqualsSource(ctx)
	require.Nil(t, exited(f), "the follower keeps running:\n%s", tail(f.Stderr(), 20))
	require.NoError(t, f.Signal(syscall.SIGTERM))
	require.NoError(t, f.Wait(time.Minute))
	require.Contains(t, f.Stdout(), "stopped following after")
	require.Zero(t, p.runStates(ctx)["running"]+p.runStates(ctx)["pending"], "no unfinished run after a SIGTERM while idle")
	report(t, "%d single-row changes at 50/s; index matched %s after the writer stopped; %d live documents", changes, s.Matching.Round(time.Millisecond), live)
}

// editedInIndex counts documents whose title the writer set, through the
// read alias.
func (p *pipeline) editedInIndex(ctx context.Context) int64 {
	res, err := p.es.Search(p.alias).Query(elastic.NewMatchQuery("title", "edit")).Size(0).Do(ctx)
	if err != nil {
		return 0
	}
	return res.TotalHits()
}

func exited(f *testproc.Proc) error {
	select {
	case <-f.Done():
		return fmt.Errorf("exited with code %d", f.ExitCode())
	default:
		return nil
	}
}

// SIGTERM in the middle of a run stops the follower at a chunk boundary
// (exit 0): the database, read over a new connection, shows the run
// released at its last checkpoint with exactly the checkpointed rows
// normalized, none running; the next follower resumes it and follows on.
func TestFollowSIGTERMStopsAtABoundary(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const rows, chunk = 60_000, 500
	p := followPipeline(t, rows, pipelineOptions{Chunk: batch.ChunkSettings{Size: chunk, Min: chunk, Max: chunk}})
	f := p.startFollower("LOG_LEVEL=warn")
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var processed int64
		require.NoError(t, p.pool.QueryRow(ctx, `SELECT COALESCE(max(processed_count), 0) FROM batch_runs WHERE job = $1`, p.spec.Job).Scan(&processed))
		if processed >= 4*chunk {
			break
		}
		require.True(t, time.Now().Before(deadline), "no progress:\n%s", tail(f.Stderr(), 20))
		pause(ctx, 10*time.Millisecond)
	}
	require.NoError(t, f.Signal(syscall.SIGTERM))
	require.NoError(t, f.Wait(time.Minute), "exit after SIGTERM:\n%s", tail(f.Stderr(), 20))

	var state string
	var processed, normalized int64
	require.NoError(t, p.pool.QueryRow(ctx, `SELECT state, processed_count FROM batch_runs WHERE job = $1 ORDER BY created_at DESC LIMIT 1`, p.spec.Job).Scan(&state, &processed))
	require.NoError(t, p.pool.QueryRow(ctx, `SELECT count(*) FROM normalized_records`).Scan(&normalized))
	require.Equal(t, "pending", state, "the stopped run is released for the next worker")
	require.Less(t, processed, int64(rows), "stopped in the middle of the run")
	require.Zero(t, processed%chunk, "stopped at a chunk boundary")
	require.Equal(t, processed, normalized, "normalized rows are exactly the checkpointed ones")
	require.Zero(t, p.runStates(ctx)["running"], "no partition left running")

	f2 := p.startFollower("LOG_LEVEL=warn")
	p.waitFollowed(ctx, 3*time.Minute, f2)
	w := p.startWriter(ctx, 50)
	pause(ctx, 3*time.Second) // the writer's window
	w.stop()
	p.waitFollowed(ctx, time.Minute, f2)
	require.NoError(t, f2.Signal(syscall.SIGTERM))
	require.NoError(t, f2.Wait(time.Minute))
	var events, distinct int64
	require.NoError(t, p.pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT (aggregate_id, aggregate_version)) FROM outbox_event_members`).Scan(&events, &distinct))
	require.Equal(t, events, distinct, "no event twice")
	require.Zero(t, p.runStates(ctx)["running"]+p.runStates(ctx)["pending"], "a follower stopped while idle leaves no unfinished run")
}

// A follower SIGKILLed inside a chunk transaction, and again right after a
// commit, while the source keeps changing, loses nothing once restarted:
// every source row ends at its last version in normalized_records, each
// version with its outbox event.
func TestFollowKill9AndRestartLosesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := followPipeline(t, 20_000, pipelineOptions{Chunk: batch.ChunkSettings{Size: 300, Min: 300, Max: 300}})
	w := p.startWriter(ctx, 100)
	const lease = "LEASE_TTL=2s"
	for _, fp := range []string{"batch.after_checkpoint@20", "batch.after_commit@7"} {
		f := p.startFollower("LOG_LEVEL=warn", lease, "OUTBOXRELAY_FAILPOINT="+fp)
		select {
		case <-f.Done():
		case <-time.After(3 * time.Minute):
			t.Fatalf("follower with %s did not die:\n%s", fp, tail(f.Stderr(), 20))
		}
		require.True(t, f.Killed(), "follower with %s: exit %d, want SIGKILL:\n%s", fp, f.ExitCode(), tail(f.Stderr(), 20))
	}
	f := p.startFollower("LOG_LEVEL=warn", lease)
	pause(ctx, 2*time.Second) // the writer keeps writing while the follower restarts
	changes := w.stop()
	p.waitFollowed(ctx, 3*time.Minute, f)
	var missing, events, distinct int64
	require.NoError(t, p.pool.QueryRow(ctx, `
SELECT count(*) FROM normalized_records n
WHERE NOT EXISTS (SELECT FROM outbox_event_members e WHERE e.aggregate_id = n.source_id AND e.aggregate_version = n.source_version)`).Scan(&missing))
	require.Zero(t, missing, "normalized rows without the event of their version")
	require.NoError(t, p.pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT (aggregate_id, aggregate_version)) FROM outbox_event_members`).Scan(&events, &distinct))
	require.Equal(t, events, distinct, "no event twice")
	require.NoError(t, f.Signal(syscall.SIGTERM))
	require.NoError(t, f.Wait(time.Minute))
	report(t, "%d changes during two SIGKILLs; nothing lost", changes)
}

// An idle follower (the trigger installed, the default poll interval)
// uses under 1% of a core: its utime+stime from /proc over a window with
// no changes, and it makes no runs in that window.
func TestFollowIdleCPU(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := followPipeline(t, 2000, pipelineOptions{})
	f := p.startFollower()
	p.waitFollowed(ctx, 2*time.Minute, f)
	// The run after the catch-up may still be under way: wait until none
	// is unfinished.
	deadline := time.Now().Add(time.Minute)
	for s := p.runStates(ctx); s["running"]+s["pending"] > 0; s = p.runStates(ctx) {
		require.True(t, time.Now().Before(deadline), "runs still unfinished: %v", s)
		pause(ctx, 50*time.Millisecond)
	}
	runsBefore := p.runStates(ctx)["succeeded"]
	const window = 15 * time.Second
	cpu0, start := procCPU(t, f.Cmd.Process.Pid), time.Now()
	pause(ctx, window) // the measuring window
	cpu1, elapsed := procCPU(t, f.Cmd.Process.Pid), time.Since(start)
	share := float64(cpu1-cpu0) / float64(elapsed)
	report(t, "idle follower: %s of CPU over %s = %.3f%% of a core", cpu1-cpu0, elapsed.Round(time.Millisecond), 100*share)
	require.Less(t, share, 0.01, "an idle follower uses under 1%% of a core")
	require.Equal(t, runsBefore, p.runStates(ctx)["succeeded"], "runs made while idle")
	require.Nil(t, exited(f))

	// And it still wakes: one change reaches normalized_records.
	_, err := p.pool.Exec(ctx, `UPDATE source_records SET payload = jsonb_set(payload, '{title}', '"after idle"') WHERE id = (SELECT min(id) FROM source_records)`)
	require.NoError(t, err)
	p.waitFollowed(ctx, 30*time.Second, f)
}

// procCPU is a process's utime+stime from /proc/<pid>/stat.
func procCPU(t *testing.T, pid int) time.Duration {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	require.NoError(t, err)
	s := string(b)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	utime, err := strconv.ParseInt(fields[11], 10, 64)
	require.NoError(t, err)
	stime, err := strconv.ParseInt(fields[12], 10, 64)
	require.NoError(t, err)
	return time.Duration(utime+stime) * 10 * time.Millisecond // USER_HZ = 100
}

// --follow on a full job exits 2 naming the flag; so does --follow with
// --run-id.
func TestFollowRefusedForFullJobs(t *testing.T) {
	t.Parallel()
	p := newPipeline(t, pipelineOptions{})
	require.NoError(t, demo.Seed(context.Background(), p.pool, demo.SeedOptions{Rows: 10}))
	b := testproc.Run(t, time.Minute, p.batcherBin, p.env(), "run", "--spec", p.specFile, "--follow")
	require.Equal(t, 2, b.ExitCode(), "stderr:\n%s", b.Stderr())
	require.Contains(t, b.Stderr(), "--follow: job records has mode full")
	b = testproc.Run(t, time.Minute, p.batcherBin, p.env(), "run", "--spec", p.specFile, "--follow", "--run-id", "r1")
	require.Equal(t, 2, b.ExitCode(), "stderr:\n%s", b.Stderr())
	require.Contains(t, b.Stderr(), "--follow with --run-id r1")
}
