package manifest_test

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/manifest"
)

// BenchmarkDrain measures a manifest job of 100,000 approved orders
// (every other order of a 200,000-row table) in chunks of 1,000: register,
// then drain with conditional UPDATE, audit, outbox events and next_index per
// chunk. The baseline is the bare set-based UPDATE of the same rows in the
// same chunk size without audit, outbox or verification; raw_ratio is the
// drain's rate over the baseline's.
//
//	go test -run '^$' -bench BenchmarkDrain -benchtime 1x ./batch/
func BenchmarkDrain(b *testing.B) {
	const items, chunk = 100_000, 1_000
	ctx := context.Background()
	var drainDur, regDur, rawDur time.Duration
	var allocBytes uint64
	for range b.N {
		b.StopTimer()
		pool := stack.Pool(b, stack.Database(b))
		_, err := pool.Exec(ctx, manifest.DemoOrdersSQL)
		require.NoError(b, err)
		_, err = pool.Exec(ctx, `
INSERT INTO orders (id, tenant_id, revision, status, qty)
SELECT g, CASE WHEN g % 2 = 0 THEN 'bench' ELSE 'other' END, 1, 'pending', 1 + g % 7
FROM generate_series(1, $1::bigint) AS g`, 2*items)
		require.NoError(b, err)
		_, err = pool.Exec(ctx, `VACUUM ANALYZE orders`)
		require.NoError(b, err)
		var sb strings.Builder
		sb.WriteString(`{"job_id":"bench","tenant":"bench","target":{"table":"orders","match_fields":["qty"]},` +
			`"transition":{"from":"pending","to":"cancelled"},"chunk_size":` + fmt.Sprint(chunk) + `,"items":[`)
		for i := range items {
			id := 2 * (i + 1)
			if i > 0 {
				sb.WriteByte(',')
			}
			fmt.Fprintf(&sb, `{"id":%d,"revision":1,"fields":{"qty":%d}}`, id, 1+id%7)
		}
		sb.WriteString(`]}`)
		b.StartTimer()

		var m0, m1 runtime.MemStats
		runtime.ReadMemStats(&m0)
		start := time.Now()
		spec, err := manifest.Parse(strings.NewReader(sb.String()))
		require.NoError(b, err)
		_, err = manifest.Register(ctx, pool, spec)
		require.NoError(b, err)
		regDur += time.Since(start)
		start = time.Now()
		res, err := manifest.Drain(ctx, pool, "bench", manifest.DrainOptions{})
		require.NoError(b, err)
		drainDur += time.Since(start)
		runtime.ReadMemStats(&m1)
		allocBytes += m1.TotalAlloc - m0.TotalAlloc
		require.Equal(b, items, res.NextIndex)

		// Baseline on the other half of the table: the same shape of
		// UPDATE ... FROM for each chunk, nothing else.
		b.StopTimer()
		start = time.Now()
		for from := 0; from < items; from += chunk {
			_, err := pool.Exec(ctx, `
UPDATE orders AS t SET status = 'cancelled', revision = t.revision + 1
FROM unnest($1::text[]) AS u(id)
WHERE t.id = u.id::bigint AND t.tenant_id = 'other' AND t.status = 'pending'`, oddIDs(from, chunk))
			require.NoError(b, err)
		}
		rawDur += time.Since(start)
		b.StartTimer()
	}
	n := float64(b.N * items)
	b.ReportMetric(n/drainDur.Seconds(), "rows/s")
	b.ReportMetric(n/regDur.Seconds(), "register_rows/s")
	b.ReportMetric(n/rawDur.Seconds(), "raw_rows/s")
	b.ReportMetric(rawDur.Seconds()/drainDur.Seconds(), "raw_ratio")
	b.ReportMetric(float64(allocBytes)/float64(b.N), "alloc_bytes/op")
}

func oddIDs(from, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprint(2*(from+i) + 1)
	}
	return out
}
