package batch_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/failpoint"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// A failed run is in batch_runs{state="failed"} after its batcher returned,
// read from the table by a collector that is not the batcher's; retrying
// the run (once the bad row is fixed) moves it to succeeded.
func TestRunStatesExportAFailedRunFromTheDatabase(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 0, 1000, 3, 1)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `UPDATE source_records SET payload = jsonb_set(payload, '{title}', '42') WHERE id = '707'`)
	require.NoError(t, err)
	s := spec()
	_, err = run(t, pool, s, batch.Config{})
	require.ErrorIs(t, err, batch.ErrBadRow)

	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(batch.NewRunStates(pool, nil))
	want := func(failed, succeeded int) string {
		return `
# HELP batch_runs Partitions of each batch job's runs per state, read from the batch_runs table at each scrape: pending, running, paused and failed over all its runs (failed stays until the run is retried or restarted), succeeded in its newest run.
# TYPE batch_runs gauge
batch_runs{job="` + s.Job + `",state="failed"} ` + itoa(failed) + `
batch_runs{job="` + s.Job + `",state="paused"} 0
batch_runs{job="` + s.Job + `",state="pending"} 0
batch_runs{job="` + s.Job + `",state="running"} 0
batch_runs{job="` + s.Job + `",state="succeeded"} ` + itoa(succeeded) + `
`
	}
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want(1, 0)), "batch_runs"))

	_, err = pool.Exec(ctx, `UPDATE source_records SET payload = jsonb_set(payload, '{title}', '"fixed"') WHERE id = '707'`)
	require.NoError(t, err)
	_, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want(0, 1)), "batch_runs"))
}

// A batcher killed in the middle of a run leaves its partition running
// with a lease nobody renews: once the lease expired the run shows in
// batch_run_stalled_seconds, read from the table by a collector that is not
// the batcher's, and a rerun that takes the partition over and finishes it
// brings the job back to 0.
func TestRunStatesExportARunWhoseBatcherWasKilled(t *testing.T) {
	t.Parallel()
	bin := testproc.Build(t, "batcher")
	url, pool := newDB(t)
	seed(t, pool, 0, 3000, 700, 1)
	s := spec()
	specFile := writeSpec(t, s)
	reg := prometheus.NewRegistry()
	reg.MustRegister(batch.NewRunStates(pool, nil))
	p := testproc.Run(t, 2*time.Minute, bin, env(url, failpoint.EnvVar+"=batch.after_commit@2", crashLease), "run", "--spec", specFile)
	require.True(t, p.Killed(), "killed after the 2nd chunk; stderr:\n%s", p.Stderr())
	require.Equal(t, "running", count(t, pool, s.Job).States)

	var stalled float64
	waitFor(t, 30*time.Second, "the killed batcher's lease to expire", func() bool {
		v, _, found := gathered(t, reg, "batch_run_stalled_seconds", s.Job)
		stalled = v
		return found && v > 0
	})
	require.Less(t, stalled, 30.0, "counted from the lease's expiry, not the run's start")

	p = testproc.Run(t, 2*time.Minute, bin, env(url, crashLease), "run", "--spec", specFile)
	require.False(t, p.Killed(), p.Stderr())
	require.Equal(t, "succeeded", count(t, pool, s.Job).States)
	v, _, found := gathered(t, reg, "batch_run_stalled_seconds", s.Job)
	require.True(t, found)
	require.Zero(t, v)
}

// batch_run_stalled_seconds counts only running partitions and sweeps
// without a live lease holder, from the later of their lease's expiry and
// their last checkpoint; a held partition whose chunk is slow, a finished
// run and a paused one count 0.
func TestRunStalledSecondsCountsOnlyPartitionsWithoutALiveHolder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	_, err := pool.Exec(ctx, `
INSERT INTO batch_jobs (job, spec) SELECT j, '{}' FROM unnest(ARRAY['crashed', 'held', 'late', 'done', 'paused', 'sweeping', 'released']) AS j;
INSERT INTO batch_runs (job, logical_run_id, partition_key, state, processor_version, scope_hash, scope, started_at, checkpoint_at, lease_token, lease_expires_at)
VALUES ('crashed', 'r1', 'a', 'running', 'v1', 'h', '{}', now() - interval '1 hour', now() - interval '10 minutes', gen_random_uuid(), now() - interval '4 minutes'),
       ('crashed', 'r1', 'b', 'running', 'v1', 'h', '{}', now() - interval '1 hour', now() - interval '1 minute', gen_random_uuid(), now() + interval '30 seconds'),
       ('held', 'r1', '', 'running', 'v1', 'h', '{}', now() - interval '1 hour', now() - interval '20 minutes', gen_random_uuid(), now() + interval '30 seconds'),
       ('late', 'r1', '', 'running', 'v1', 'h', '{}', now() - interval '1 hour', now() - interval '20 seconds', gen_random_uuid(), now() - interval '3 minutes'),
       ('done', 'r1', '', 'succeeded', 'v1', 'h', '{}', now() - interval '1 hour', now() - interval '50 minutes', NULL, now() - interval '50 minutes'),
       ('paused', 'r1', '', 'paused', 'v1', 'h', '{}', now() - interval '1 hour', now() - interval '50 minutes', NULL, now() - interval '50 minutes'),
       ('sweeping', 'r1', '', 'succeeded', 'v1', 'h', '{}', now() - interval '1 hour', now() - interval '30 minutes', NULL, NULL),
       ('released', 'r1', '', 'succeeded', 'v1', 'h', '{}', now() - interval '1 hour', now() - interval '30 minutes', NULL, NULL);
-- A batcher that stops softly in the middle of a sweep leaves it running
-- without a lease token (releaseSweepSQL), its lease's expiry ahead.
INSERT INTO batch_sweeps (job, logical_run_id, state, started_at, checkpoint_at, lease_token, lease_expires_at)
VALUES ('sweeping', 'r1', 'running', now() - interval '30 minutes', now() - interval '8 minutes', gen_random_uuid(), now() - interval '7 minutes'),
       ('released', 'r1', 'running', now() - interval '30 minutes', now() - interval '8 minutes', NULL, now() + interval '20 seconds')`)
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	reg.MustRegister(batch.NewRunStates(pool, nil))
	tests := []struct {
		name string
		job  string
		want float64
	}{
		{name: "killed holder: from its lease's expiry", job: "crashed", want: 240},
		{name: "live holder, slow chunk", job: "held", want: 0},
		{name: "expired lease, later checkpoint: from the checkpoint", job: "late", want: 20},
		{name: "finished run", job: "done", want: 0},
		{name: "paused run", job: "paused", want: 0},
		{name: "abandoned sweep", job: "sweeping", want: 420},
		{name: "sweep released by a soft stop", job: "released", want: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v, _, found := gathered(t, reg, "batch_run_stalled_seconds", tt.job)
			require.True(t, found, "a series for job %s", tt.job)
			require.InDelta(t, tt.want, v, 15)
		})
	}
}

func itoa(n int) string { return strconv.Itoa(n) }
