package manifest_test

import (
	"context"
	"encoding/json"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/failpoint"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
	"github.com/outboxrelay/outboxrelay/manifest"
)

const procTimeout = 2 * time.Minute

func (f *fixture) env(extra ...string) []string {
	return append([]string{"DATABASE_URL=" + f.url, "LOG_FORMAT=json", failpoint.EnvVar + "="}, extra...)
}

// The client is killed at each failpoint of the second chunk: the database,
// read over a new connection, holds exactly the chunks committed before,
// and a new drain finishes the job with every order changed once.
func TestCrashAtEachFailpointThenResume(t *testing.T) {
	t.Parallel()
	bin := testproc.Build(t, "batcher")
	for _, tc := range []struct {
		failpoint string
		committed int // items committed when the process dies
	}{
		{manifest.FailpointAfterUpdate, 10},
		{manifest.FailpointAfterAudit, 10},
		{manifest.FailpointAfterNextIndex, 10},
		{manifest.FailpointAfterCommit, 20},
	} {
		t.Run(tc.failpoint, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, fixtureOpts{ids: nonContiguousIDs(43), chunkSize: 10})
			f.register(t)

			p := testproc.Run(t, procTimeout, bin, f.env(failpoint.EnvVar+"="+tc.failpoint+"@2"), "manifest", "drain", "--job", f.jobID)
			require.True(t, p.Killed(), "exit %d, stderr:\n%s", p.ExitCode(), p.Stderr())
			require.Contains(t, p.Stderr(), "failpoint "+tc.failpoint)
			require.Contains(t, p.Stdout(), "chunk 0 committed")
			require.NotContains(t, p.Stdout(), "chunk 1 committed", "the client died before answering for chunk 1")

			f.checkExactlyOnce(t, tc.committed)
			s := f.snapshot(t)
			require.Equal(t, manifest.StateRunning, s.State)

			p = testproc.Run(t, procTimeout, bin, f.env(), "manifest", "drain", "--job", f.jobID, "--json")
			require.Equal(t, 0, p.ExitCode(), p.Stderr())
			var res manifest.DrainResult
			require.NoError(t, json.Unmarshal([]byte(p.Stdout()), &res), p.Stdout())
			require.Equal(t, manifest.StoppedCompleted, res.Stopped)
			require.Len(t, res.ProcessedIDs, 43-tc.committed)
			require.Equal(t, 43, res.NextIndex)
			f.checkExactlyOnce(t, 43)
			require.Equal(t, manifest.StateSucceeded, f.snapshot(t).State)
		})
	}
}

// Two processes drain the same job at the same time: every approved id is
// changed and audited exactly once.
func TestTwoProcessesDrainOneJob(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	bin := testproc.Build(t, "batcher")
	f := newFixture(t, fixtureOpts{ids: nonContiguousIDs(43), chunkSize: 3})
	f.register(t)

	// Hold the job row so both processes are queued on it before either
	// takes a chunk; then they take turns chunk by chunk.
	tx, err := f.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM manifest_jobs WHERE job_id = $1 FOR UPDATE`, f.jobID)
	require.NoError(t, err)
	procs := []*testproc.Proc{
		testproc.Start(t, bin, f.env(), "manifest", "drain", "--job", f.jobID, "--json"),
		testproc.Start(t, bin, f.env(), "manifest", "drain", "--job", f.jobID, "--json"),
	}
	waitFor(t, time.Minute, "both drains wait for the job row", func() bool {
		var waiting int
		require.NoError(t, f.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting))
		return waiting == 2
	})
	require.NoError(t, tx.Commit(ctx))

	var all []string
	for i, p := range procs {
		require.NoError(t, p.Wait(procTimeout), "drain %d: %s", i, p.Stderr())
		var res manifest.DrainResult
		require.NoError(t, json.Unmarshal([]byte(p.Stdout()), &res), p.Stdout())
		require.Equal(t, manifest.StoppedCompleted, res.Stopped)
		t.Logf("drain %d changed %d item(s) in %d chunk(s)", i, len(res.ProcessedIDs), len(res.Chunks))
		all = append(all, res.ProcessedIDs...)
	}
	want := make([]string, len(f.ids))
	for i, id := range f.ids {
		want[i] = strconv.FormatInt(id, 10)
	}
	slices.SortFunc(all, func(a, b string) int {
		x, _ := strconv.ParseInt(a, 10, 64)
		y, _ := strconv.ParseInt(b, 10, 64)
		return int(x - y)
	})
	require.Equal(t, want, all, "the two answers together: each id once")
	// The independent check over the target, the audit and the outbox.
	f.checkExactlyOnce(t, 43)
}

// The commands as an operator runs them: registration idempotency and
// conflict exit codes, malformed files, drain stopping at a conflict with
// exit 3, report (table and JSON) and status.
func TestCommands(t *testing.T) {
	t.Parallel()
	bin := testproc.Build(t, "batcher")
	ctx := context.Background()
	f := newFixture(t, fixtureOpts{ids: contiguousIDs(40), chunkSize: 10})
	run := func(env []string, args ...string) *testproc.Proc {
		t.Helper()
		return testproc.Run(t, procTimeout, bin, env, args...)
	}

	p := run(f.env(), "manifest", "register", "--file", f.file)
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.Contains(t, p.Stdout(), "registered manifest job festival-cancel: 40 items, chunk size 10")

	p = run(f.env("MANIFEST_FILE="+f.file), "manifest", "register")
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.Contains(t, p.Stdout(), "already registered with the same content")

	other := cloneSpec(f.spec)
	other["tenant"] = "someone-else"
	p = run(f.env(), "manifest", "register", "--file", f.writeFile(t, other))
	require.Equal(t, 3, p.ExitCode(), p.Stderr())
	require.Contains(t, p.Stderr(), "nothing changed")

	p = run(f.env(), "manifest", "register", "--file", filepath.Join("testdata", "duplicate_id.json"))
	require.Equal(t, 2, p.ExitCode(), p.Stderr())
	require.Contains(t, p.Stderr(), "items[2] (id 3): duplicate id")

	p = run(f.env(), "manifest", "drain", "--job", f.jobID, "--max-chunks", "1")
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.Contains(t, p.Stdout(), "chunk 0 committed: positions 0..9, 10 item(s) changed, 10 event(s); next_index 10 of 40")
	require.Contains(t, p.Stdout(), "stopped: max_chunks")

	_, err := f.pool.Exec(ctx, `UPDATE orders SET qty = 99 WHERE id = 15`)
	require.NoError(t, err)
	p = run(f.env(), "manifest", "drain", "--job", f.jobID)
	require.Equal(t, 3, p.ExitCode(), p.Stderr())
	require.Contains(t, p.Stderr(), "is now conflicted")
	require.Contains(t, p.Stderr(), "id 15 (position 14): revision: approved 1, found 2")

	p = run(f.env(), "manifest", "report", "--job", f.jobID)
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.Contains(t, p.Stdout(), "state        conflicted")
	require.Contains(t, p.Stdout(), "committed    10: 1 2 3 4 5 6 7 8 9 10")
	require.Contains(t, p.Stdout(), "verification ok")

	p = run(f.env(), "manifest", "report", "--job", f.jobID, "--json")
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	var rep manifest.Report
	require.NoError(t, json.Unmarshal([]byte(p.Stdout()), &rep))
	require.Equal(t, manifest.StateConflicted, rep.Job.State)
	require.Equal(t, "15", rep.Job.Conflict.Items[0].ID)
	require.Len(t, rep.Committed, 10)
	require.Len(t, rep.Matching, 10)
	require.Len(t, rep.Unprocessed, 30)

	p = run(f.env(), "manifest", "status")
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	lines := strings.Split(strings.TrimSpace(p.Stdout()), "\n")
	require.Len(t, lines, 2)
	require.Regexp(t, `^festival-cancel\s+alien-desserts\s+conflicted\s+10/40\s+10\s+1\s`, lines[1])

	p = run(f.env(), "manifest", "drain")
	require.Equal(t, 2, p.ExitCode())
	require.Contains(t, p.Stderr(), "--job is required")
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting until %s", timeout, what)
		}
		<-tick.C
	}
}

// SIGTERM while a chunk is in flight: the chunk commits, no other starts,
// the process exits 0 at that chunk.
func TestSoftStopFinishesTheChunkInFlight(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	bin := testproc.Build(t, "batcher")
	f := newFixture(t, fixtureOpts{ids: nonContiguousIDs(43), chunkSize: 10})
	f.register(t)

	tx, err := f.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM manifest_jobs WHERE job_id = $1 FOR UPDATE`, f.jobID)
	require.NoError(t, err)
	p := testproc.Start(t, bin, f.env(), "manifest", "drain", "--job", f.jobID)
	waitFor(t, time.Minute, "the drain waits for the job row inside its first chunk", func() bool {
		var waiting int
		require.NoError(t, f.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting))
		return waiting == 1
	})
	require.NoError(t, p.Signal(syscall.SIGTERM))
	waitFor(t, time.Minute, "the drain logs the soft stop", func() bool {
		return strings.Contains(p.Stderr(), "stopping softly")
	})
	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, p.Wait(procTimeout), p.Stderr())
	require.Contains(t, p.Stdout(), "stopped: stop")
	f.checkExactlyOnce(t, 10)
}
