package batch_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

func TestCommands(t *testing.T) {
	t.Parallel()
	bin := testproc.Build(t, "batcher")
	url, pool := newDB(t)
	seed(t, pool, 0, 3000, 3, 1)
	_, err := pool.Exec(t.Context(), `UPDATE source_records SET payload = '"oops"' WHERE id = 14`)
	require.NoError(t, err)
	specFile := writeSpec(t, spec(func(s *batch.Spec) { s.Errors.Policy = batch.PolicyQuarantine }))
	cmd := func(args ...string) *testproc.Proc {
		t.Helper()
		return testproc.Run(t, time.Minute, bin, env(url), args...)
	}

	p := cmd("run", "--help")
	require.Equal(t, 0, p.ExitCode())
	require.Contains(t, p.Stdout(), "--max-chunks  (env MAX_CHUNKS, default 0)")

	p = cmd("run", "--spec", specFile, "--max-chunks", "1")
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.Contains(t, p.Stdout(), "stopped at the last committed checkpoint (1 chunks, 500 rows, 499 changed, 1 quarantined")

	p = cmd("status", "--job", "records")
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.Regexp(t, `records\s+\S+\s+-\s+pending\s+2024-01-01T00:02:46\+00:00,3493\s+500/~3000\s+\d+/s\s+\S+\s+1\s+0`, p.Stdout())

	bad := writeSpec(t, spec(func(s *batch.Spec) { s.Errors.Policy = batch.PolicyQuarantine; s.ProcessorVersion = "v2" }))
	p = cmd("run", "--spec", bad)
	require.Equal(t, 3, p.ExitCode(), "conflict")
	require.Contains(t, p.Stderr(), "processor version v1, the spec has v2; rerun with --restart")

	p = cmd("pause", "--job", "records")
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.Contains(t, p.Stdout(), "1 partition(s) of job records set to paused")
	p = cmd("resume", "--job", "records")
	require.Equal(t, 0, p.ExitCode(), p.Stderr())

	p = cmd("checkpoint", "set", "--job", "records", "--run-id", "x", "--cursor", "a,b")
	require.Equal(t, 2, p.ExitCode(), "usage: no reason")
	require.Contains(t, p.Stderr(), "--reason are required")

	p = cmd("run", "--job", "records")
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.Contains(t, p.Stdout(), "succeeded (5 chunks, 2500 rows, 2500 changed, 0 quarantined")

	p = cmd("quarantine", "list", "--job", "records")
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.Regexp(t, `records\s+\S+\s+-\s+14\s+not_an_object\s+column payload is not a JSON object\s+1`, p.Stdout())
	_, err = pool.Exec(t.Context(), `UPDATE source_records SET payload = '{"title":"ok"}' WHERE id = 14`)
	require.NoError(t, err)
	p = cmd("quarantine", "retry", "--job", "records")
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.Contains(t, p.Stdout(), "retried 1 quarantined row(s) of job records: 1 resolved, 0 still bad")
	require.Equal(t, counts{Normalized: 3000, Events: 3000, DistinctEvents: 3000, Processed: 3000, States: "succeeded"}, count(t, pool, "records"))
}
