package migrate_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/migrate"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

func TestMain(m *testing.M) { stack.Main(m) }

// emptyDatabase creates a database with no migrations applied.
func emptyDatabase(t *testing.T) string {
	t.Helper()
	ctx := context.Background()
	base := stack.ServerURL(t)
	name := strings.ReplaceAll(stack.UniqueName("migrate"), "-", "_")
	conn, err := pgx.Connect(ctx, base)
	require.NoError(t, err)
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, fmt.Sprintf("CREATE DATABASE %s", pgx.Identifier{name}.Sanitize()))
	require.NoError(t, err)
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), base)
		if err == nil {
			_, _ = c.Exec(context.Background(), fmt.Sprintf("DROP DATABASE IF EXISTS %s WITH (FORCE)", pgx.Identifier{name}.Sanitize()))
			c.Close(context.Background())
		}
	})
	return stack.WithDatabase(base, name)
}

func TestUpConcurrentRunnersApplyEachMigrationOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := emptyDatabase(t)
	all, err := migrate.All()
	require.NoError(t, err)
	require.NotEmpty(t, all)

	const runners = 4
	results := make([]migrate.Result, runners)
	errs := make([]error, runners)
	var wg sync.WaitGroup
	for i := range runners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pool, err := pgxpool.New(ctx, url)
			if err != nil {
				errs[i] = err
				return
			}
			defer pool.Close()
			results[i], errs[i] = migrate.Up(ctx, pool, nil)
		}()
	}
	wg.Wait()
	applied := 0
	for i := range runners {
		require.NoError(t, errs[i])
		require.Equal(t, all[len(all)-1].Version, results[i].Current)
		applied += len(results[i].Applied)
	}
	require.Equal(t, len(all), applied, "every migration applied exactly once across the runners")

	pool := stack.Pool(t, url)
	var versions []int32
	rows, err := pool.Query(ctx, `SELECT version FROM outboxrelay_migrations ORDER BY version`)
	require.NoError(t, err)
	versions, err = pgx.CollectRows(rows, pgx.RowTo[int32])
	require.NoError(t, err)
	require.Len(t, versions, len(all))
	var tables int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE tablename IN ('outbox_events', 'normalized_records')`).Scan(&tables))
	require.Equal(t, 2, tables)

	// A second run is a no-op.
	res, err := migrate.Up(ctx, pool, nil)
	require.NoError(t, err)
	require.Empty(t, res.Applied)
}
