package batch_test

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
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
# HELP batch_runs Partitions of each batch job's runs per state (pending, running, paused, failed, succeeded), read from the batch_runs table at each scrape; failed stays until the run is retried or restarted.
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

func itoa(n int) string { return strconv.Itoa(n) }
