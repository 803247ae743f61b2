package batch_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/failpoint"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// writeSpec writes s as a JSON spec file.
func writeSpec(t *testing.T, s batch.Spec) string {
	t.Helper()
	b, err := json.Marshal(s)
	require.NoError(t, err)
	p := filepath.Join(t.TempDir(), "job.json")
	require.NoError(t, os.WriteFile(p, b, 0o600))
	return p
}

func env(url string, extra ...string) []string {
	return append([]string{"DATABASE_URL=" + url, "METRICS_ADDR=", "LOG_FORMAT=json", "PROGRESS=off", failpoint.EnvVar + "="}, extra...)
}

// waitFor polls cond (on a fresh query each time) until it holds.
// waitFor waits for cond; on a timeout it prints the stderr of procs.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool, procs ...*testproc.Proc) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			for i, p := range procs {
				t.Logf("process %d stderr:\n%s", i, p.Stderr())
			}
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		<-tick.C
	}
}

func queryInt(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int64 {
	t.Helper()
	var n int64
	require.NoError(t, pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

// exact checks the final state with a new connection: every row once, one
// event per (row, version), the checkpoint at the boundary.
func exact(t *testing.T, url string, job string, rows int64) {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(t, err)
	defer pool.Close()
	require.Equal(t, counts{Normalized: rows, Events: rows, DistinctEvents: rows, Processed: rows, States: "succeeded"}, count(t, pool, job))
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM source_records s LEFT JOIN outbox_event_members e ON e.aggregate_id = s.id::text AND e.aggregate_version = s.version WHERE e.id IS NULL`))
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM batch_runs WHERE job = $1 AND state = 'succeeded' AND cursor IS DISTINCT FROM boundary`, job))
}

// crashLease is the lease of the runs in these tests: short, so a rerun
// takes over a killed worker's partition quickly. A chunk may take longer
// than the lease (a pipelined chunk waiting for the one before it reads the
// lease meanwhile, see TestPipelinedChunkOutwaitsTheLease).
const crashLease = "LEASE_TTL=1s"

func TestFailpointsCrashAndResume(t *testing.T) {
	t.Parallel()
	bin := testproc.Build(t, "batcher")
	tests := []struct {
		point     string
		committed int64 // rows committed when the process dies at the 3rd chunk, one chunk at a time
		// With two chunks in flight the 3rd hit may be either chunk's, and
		// the chunk after a committed one may commit before the kill: the
		// committed rows are whole chunks in [lo, hi].
		lo, hi int64
	}{
		{point: "batch.before_tx", committed: 1000, lo: 500, hi: 1000},
		{point: "batch.after_upsert", committed: 1000, lo: 500, hi: 1000},
		{point: "batch.after_outbox", committed: 1000, lo: 500, hi: 1000},
		{point: "batch.after_checkpoint", committed: 1000, lo: 500, hi: 1000},
		{point: "batch.after_commit", committed: 1500, lo: 1500, hi: 2000},
	}
	for _, tt := range tests {
		for _, pipeline := range []int{1, 2} {
			t.Run(fmt.Sprintf("%s/pipeline=%d", tt.point, pipeline), func(t *testing.T) {
				t.Parallel()
				url, pool := newDB(t)
				seed(t, pool, 0, 3000, 700, 1)
				specFile := writeSpec(t, spec(func(s *batch.Spec) { s.Chunk.Pipeline = pipeline }))
				p := testproc.Run(t, 2*time.Minute, bin, env(url, failpoint.EnvVar+"="+tt.point+"@3", crashLease), "run", "--spec", specFile)
				require.True(t, p.Killed(), "killed at %s; stderr:\n%s", tt.point, p.Stderr())
				require.Contains(t, p.Stderr(), "failpoint "+tt.point)
				if tt.point == "batch.after_commit" && pipeline == 1 {
					require.NotContains(t, p.Stderr(), `"processed":1500`, "killed before the log line of the committed chunk")
				}

				check, err := pgxpool.New(context.Background(), url)
				require.NoError(t, err)
				defer check.Close()
				c := count(t, check, "records")
				if pipeline == 1 {
					require.Equal(t, counts{Normalized: tt.committed, Events: tt.committed, DistinctEvents: tt.committed, Processed: tt.committed, States: "running"}, c)
				} else {
					require.Equal(t, counts{Normalized: c.Processed, Events: c.Processed, DistinctEvents: c.Processed, Processed: c.Processed, States: "running"}, c, "rows, events and checkpoint agree")
					require.Zero(t, c.Processed%500, "whole chunks only")
					require.True(t, c.Processed >= tt.lo && c.Processed <= tt.hi, "committed %d, want %d..%d", c.Processed, tt.lo, tt.hi)
				}

				p = testproc.Run(t, 2*time.Minute, bin, env(url, crashLease), "run", "--spec", specFile)
				require.Equal(t, 0, p.ExitCode(), p.Stderr())
				exact(t, url, "records", 3000)
			})
		}
	}

	t.Run("seed: a 500-row chunk killed mid-way leaves nothing", func(t *testing.T) {
		t.Parallel()
		url, pool := newDB(t)
		seed(t, pool, 0, 1000, 3, 1)
		specFile := writeSpec(t, spec())
		p := testproc.Run(t, 2*time.Minute, bin, env(url, failpoint.EnvVar+"=batch.after_upsert@1", crashLease), "run", "--spec", specFile)
		require.True(t, p.Killed())
		require.Equal(t, counts{States: "running"}, count(t, pool, "records"))
		p = testproc.Run(t, 2*time.Minute, bin, env(url, crashLease), "run", "--spec", specFile)
		require.Equal(t, 0, p.ExitCode(), p.Stderr())
		exact(t, url, "records", 1000)
	})
}

// waitExit waits for the process to end, whatever its exit code.
func waitExit(p *testproc.Proc, timeout time.Duration) error {
	err := p.Wait(timeout)
	if _, ok := err.(*exec.ExitError); ok {
		return nil
	}
	return err
}

func TestSIGTERMStopsAtChunkBoundary(t *testing.T) {
	t.Parallel()
	bin := testproc.Build(t, "batcher")
	url, pool := newDB(t)
	seed(t, pool, 0, 30_000, 3, 1)
	specFile := writeSpec(t, spec(func(s *batch.Spec) { s.Chunk = batch.ChunkSettings{Size: 200, Min: 200, Max: 200} }))
	p := testproc.Start(t, bin, env(url), "run", "--spec", specFile)
	waitFor(t, time.Minute, "some chunks committed", func() bool {
		return queryInt(t, pool, `SELECT COALESCE(sum(processed_count), 0) FROM batch_runs`) >= 1000
	})
	require.NoError(t, p.Signal(syscall.SIGTERM))
	require.NoError(t, p.Wait(time.Minute), p.Stderr())
	require.Equal(t, 0, p.ExitCode())
	require.Contains(t, p.Stderr(), "stopped at the last committed checkpoint")

	var state string
	var processed int64
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT state, processed_count FROM batch_runs`).Scan(&state, &processed))
	require.Equal(t, "pending", state, "lease released")
	require.Zero(t, processed%200, "a chunk boundary")
	require.Less(t, processed, int64(30_000))
	require.Equal(t, processed, queryInt(t, pool, `SELECT count(*) FROM normalized_records`))
	require.Equal(t, processed, queryInt(t, pool, `SELECT count(*) FROM outbox_event_members`))

	p = testproc.Run(t, 2*time.Minute, bin, env(url), "run", "--spec", specFile)
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	exact(t, url, "records", 30_000)
}

func TestTwoWorkersShareAndFence(t *testing.T) {
	t.Parallel()
	bin := testproc.Build(t, "batcher")
	url, pool := newDB(t)
	seed(t, pool, 0, 12_000, 3, 4) // tenants t0..t3
	specFile := writeSpec(t, spec(func(s *batch.Spec) {
		s.Source.Partition = "tenant_id"
		s.Chunk = batch.ChunkSettings{Size: 100, Min: 100, Max: 100}
	}))
	args := []string{"run", "--spec", specFile, "--run-id", "r1", "--lease-ttl", "2s"}
	// A first, alone: started together, B could claim every partition
	// before a slow A (a loaded machine) claimed one, or take A's
	// partition over when A's lease looked stale, and A would never be
	// seen working. B starts once A is frozen holding a partition.
	a := testproc.Start(t, bin, env(url, "WORKER_ID=A"), args...)
	waitFor(t, time.Minute, "A working on a partition", func() bool {
		return queryInt(t, pool, `SELECT count(*) FROM batch_runs WHERE lease_owner LIKE 'A/%' AND state = 'running' AND processed_count > 0`) > 0
	}, a)
	require.NoError(t, a.Signal(syscall.SIGSTOP))
	// Read after the freeze: A may have moved on to the next partition.
	var frozen string
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT partition_key FROM batch_runs WHERE lease_owner LIKE 'A/%' AND state = 'running'`).Scan(&frozen))
	t.Logf("A frozen holding partition %s", frozen)
	require.Equal(t, int64(4), queryInt(t, pool, `SELECT count(*) FROM batch_runs WHERE job = 'records' AND logical_run_id = 'r1'`))
	b := testproc.Start(t, bin, env(url, "WORKER_ID=B"), args...)

	waitFor(t, 2*time.Minute, "B to take over A's partition", func() bool {
		return queryInt(t, pool, `SELECT count(*) FROM batch_runs WHERE partition_key = $1 AND (lease_owner LIKE 'B/%' OR state = 'succeeded')`, frozen) == 1
	})
	require.NoError(t, waitExit(b, 2*time.Minute), b.Stderr())
	require.Equal(t, 0, b.ExitCode(), b.Stderr())
	require.Equal(t, int64(4), queryInt(t, pool, `SELECT count(*) FROM batch_runs WHERE state = 'succeeded'`))
	// A finished run keeps no lease owner, so the workers' logs say who did
	// what: B took over and finished the partition A froze holding.
	require.Contains(t, logged(t, b, "partition claimed"), frozen, "B claimed the partition A froze holding")
	require.Contains(t, logged(t, b, "partition succeeded"), frozen, "B finished it")

	require.NoError(t, a.Signal(syscall.SIGCONT))
	require.NoError(t, waitExit(a, time.Minute))
	require.NotEqual(t, 0, a.ExitCode(), "a worker that lost its lease does not report success")
	require.Contains(t, a.Stderr(), "lease lost")
	require.NotContains(t, a.Stdout(), "succeeded")

	exact(t, url, "records", 12_000)
	// A's partitions and B's partitions: both workers did part of the job.
	require.Contains(t, a.Stderr(), "partition claimed")
	require.Contains(t, b.Stderr(), "partition claimed")
}

// logged returns the partitions of p's JSON log lines whose message is msg.
func logged(t *testing.T, p *testproc.Proc, msg string) []string {
	t.Helper()
	var parts []string
	for _, line := range strings.Split(p.Stderr(), "\n") {
		var l struct{ Msg, Partition string }
		if json.Unmarshal([]byte(line), &l) == nil && l.Msg == msg {
			parts = append(parts, l.Partition)
		}
	}
	return parts
}

func TestSecondSignalCancelsTheChunk(t *testing.T) {
	t.Parallel()
	bin := testproc.Build(t, "batcher")
	url, pool := newDB(t)
	seed(t, pool, 0, 2000, 3, 1)
	ctx := context.Background()
	// An open transaction holds the key of the first row, so the first
	// chunk's upsert waits on it: a chunk certainly in flight.
	blocker, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer blocker.Rollback(ctx)
	_, err = blocker.Exec(ctx, `INSERT INTO normalized_records (source, source_id, source_version, processor_version) VALUES ('source_records', '0', 1, 'v0')`)
	require.NoError(t, err)

	specFile := writeSpec(t, spec(func(s *batch.Spec) { s.Chunk.LockTimeout = batch.Duration(time.Minute) }))
	p := testproc.Start(t, bin, env(url, "SHUTDOWN_GRACE=0"), "run", "--spec", specFile)
	waitFor(t, time.Minute, "the chunk waiting on the lock", func() bool {
		return queryInt(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'outboxrelay' AND wait_event_type = 'Lock'`) == 1
	})
	require.NoError(t, p.Signal(syscall.SIGTERM))
	waitFor(t, time.Minute, "the soft stop logged", func() bool { return strings.Contains(p.Stderr(), "stopping softly") })
	require.NoError(t, p.Signal(syscall.SIGTERM))
	require.NoError(t, waitExit(p, time.Minute))
	require.NotEqual(t, 0, p.ExitCode(), "a hard stop is not a clean exit")
	require.Contains(t, p.Stderr(), "hard stop: chunk rolled back")
	require.NoError(t, blocker.Rollback(ctx))

	require.Equal(t, counts{States: "pending"}, count(t, pool, "records"), "nothing committed, lease released")
	p = testproc.Run(t, time.Minute, bin, env(url), "run", "--spec", specFile)
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	exact(t, url, "records", 2000)
}
