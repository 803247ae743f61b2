package batch_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

func TestMain(m *testing.M) { stack.Main(m) }

// newDB returns a fresh migrated database with the demo source table.
func newDB(t *testing.T) (string, *pgxpool.Pool) {
	t.Helper()
	url := stack.Database(t)
	pool := stack.Pool(t, url)
	_, err := pool.Exec(context.Background(), batch.DemoSchemaSQL)
	require.NoError(t, err)
	return url, pool
}

// seed inserts n rows server-side: created_at in groups of tie rows sharing
// one timestamp, ids not contiguous (steps of 7), a small JSON payload.
// from offsets the row numbers so later calls add newer rows.
func seed(t *testing.T, pool *pgxpool.Pool, from, n, tie int, tenants int) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `
INSERT INTO source_records (id, created_at, tenant_id, payload)
SELECT g * 7, timestamptz '2024-01-01 00:00:00+00' + (g / $3) * interval '1 second',
       't' || (g % $4), jsonb_build_object('title', '  Title ' || g || '  ', 'body', repeat('x', 40), 'tags', jsonb_build_array('a', 'b'))
FROM generate_series($1::int, $1::int + $2::int - 1) g`, from, n, tie, tenants)
	require.NoError(t, err)
}

func spec(mut ...func(*batch.Spec)) batch.Spec {
	s := batch.DemoSpec()
	s.Errors.Policy = batch.PolicyStrict
	s.Chunk = batch.ChunkSettings{Size: 500, Min: 500, Max: 500}
	// A failed partition fails the run at once, as these tests check;
	// attempts_test.go tests the automatic retries.
	s.Errors.PartitionAttempts = 1
	for _, m := range mut {
		m(&s)
	}
	return s
}

func run(t *testing.T, pool *pgxpool.Pool, s batch.Spec, cfg batch.Config) (*batch.Summary, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	r, err := batch.NewRunner(pool, s, cfg)
	require.NoError(t, err)
	return r.Run(ctx, ctx)
}

type counts struct {
	Normalized, Events, DistinctEvents, Processed int64
	States                                        string
}

// count reads the counts in one snapshot: a killed batcher's backend may
// still be committing its last chunk while they are read, and separate
// statements would see it half (rows before the commit, events after).
func count(t *testing.T, pool *pgxpool.Pool, job string) counts {
	t.Helper()
	var c counts
	ctx := context.Background()
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM normalized_records`).Scan(&c.Normalized))
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*), count(DISTINCT (aggregate_id, aggregate_version)) FROM outbox_event_members`).Scan(&c.Events, &c.DistinctEvents))
	require.NoError(t, tx.QueryRow(ctx, `SELECT COALESCE(sum(processed_count), 0), COALESCE(string_agg(DISTINCT state, ','), '') FROM batch_runs WHERE job = $1 AND state <> 'superseded'
		AND logical_run_id = (SELECT logical_run_id FROM batch_runs WHERE job = $1 ORDER BY created_at DESC LIMIT 1)`, job).Scan(&c.Processed, &c.States))
	return c
}
