package stack_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// A transaction that writes two tables commits both or neither: kill the
// connection in the middle and look over a new one.
func TestSmokePostgresAtomicTwoTables(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := stack.Database(t)
	admin := stack.Pool(t, url)

	var version string
	require.NoError(t, admin.QueryRow(ctx, `SELECT version()`).Scan(&version))
	t.Logf("PostgreSQL server: %s", version)

	_, err := admin.Exec(ctx, `CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE b (id int PRIMARY KEY)`)
	require.NoError(t, err)

	victim, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	tx, err := victim.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO a VALUES (1)`)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO b VALUES (1)`)
	require.NoError(t, err)
	var pid int32
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))

	// The server ends the backend as a crash of the client would.
	var killed bool
	require.NoError(t, admin.QueryRow(ctx, `SELECT pg_terminate_backend($1, 5000)`, pid).Scan(&killed))
	require.True(t, killed)
	require.Error(t, tx.Commit(ctx), "commit on a killed connection must fail")

	var na, nb int
	require.NoError(t, admin.QueryRow(ctx, `SELECT (SELECT count(*) FROM a), (SELECT count(*) FROM b)`).Scan(&na, &nb))
	require.Equal(t, 0, na)
	require.Equal(t, 0, nb)

	// And the committed case writes both.
	fresh, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer fresh.Close(ctx)
	require.NoError(t, pgx.BeginFunc(ctx, fresh, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO a VALUES (2)`); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO b VALUES (2)`)
		return err
	}))
	require.NoError(t, admin.QueryRow(ctx, `SELECT (SELECT count(*) FROM a), (SELECT count(*) FROM b)`).Scan(&na, &nb))
	require.Equal(t, 1, na)
	require.Equal(t, 1, nb)
}

// The keyset predicate the batcher uses is answered from the (created_at, id)
// index, not by a scan and sort.
func TestSmokePostgresKeysetUsesIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	_, err := pool.Exec(ctx, `
		CREATE TABLE src (id bigint PRIMARY KEY, created_at timestamptz NOT NULL, payload text);
		CREATE INDEX src_keyset ON src (created_at, id);
		INSERT INTO src SELECT g, timestamptz '2026-01-01' + (g / 7) * interval '1 second', 'x'
		FROM generate_series(1, 50000) g;
		ANALYZE src;`)
	require.NoError(t, err)

	rows, err := pool.Query(ctx, `EXPLAIN SELECT id FROM src WHERE (created_at, id) > ($1, $2) ORDER BY created_at, id LIMIT 500`,
		time.Date(2026, 1, 1, 1, 0, 0, 0, time.UTC), int64(100))
	require.NoError(t, err)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	plan := strings.Join(lines, "\n")
	t.Logf("plan:\n%s", plan)
	require.Contains(t, plan, "Index")
	require.Contains(t, plan, "src_keyset")
	require.NotContains(t, plan, "Sort")
	require.NotContains(t, plan, "Seq Scan")
}
