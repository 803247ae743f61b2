package cli_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

func TestMain(m *testing.M) { stack.Main(m) }

func dbCommand(check func() error, run func(context.Context, cli.DB) error) []cli.Command {
	var n int
	return []cli.Command{cli.DBCommand{
		Name: "count", Summary: "test", Synopsis: "Counts.", Conns: 1,
		Flags: func(fs *cli.FlagSet) { fs.Int(&n, "n", "COUNT_N", 1, "how many") },
		Check: check, Run: run,
	}.Command("x")}
}

// A DBCommand refuses bad settings (exit 2) before it connects, and opens a
// working pool for Run that is closed when Run returns.
func TestDBCommandChecksThenOpensAndCloses(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://127.0.0.1:1/nowhere")
	ran := false
	var out, errOut bytes.Buffer
	code := cli.Dispatch(context.Background(), "x", "test", dbCommand(func() error { return cli.UsageError("COUNT_N=0: want > 0") },
		func(context.Context, cli.DB) error { ran = true; return nil }), []string{"count"}, &out, &errOut)
	require.Equal(t, cli.ExitUsage, code)
	require.Contains(t, errOut.String(), "x count: COUNT_N=0: want > 0")
	require.False(t, ran)

	t.Setenv("DATABASE_URL", "")
	errOut.Reset()
	code = cli.Dispatch(context.Background(), "x", "test", dbCommand(nil, func(context.Context, cli.DB) error { ran = true; return nil }), []string{"count"}, &out, &errOut)
	require.Equal(t, cli.ExitError1, code)
	require.Contains(t, errOut.String(), "DATABASE_URL is empty: set --database-url or DATABASE_URL")
	require.False(t, ran)

	t.Setenv("DATABASE_URL", stack.Database(t))
	var pool *pgxpool.Pool
	errOut.Reset()
	code = cli.Dispatch(context.Background(), "x", "test", dbCommand(nil, func(ctx context.Context, db cli.DB) error {
		pool = db.Pool
		var one int
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT 1`).Scan(&one))
		require.Equal(t, []string{"left"}, db.Args)
		require.NotNil(t, db.Logger)
		return nil
	}), []string{"count", "--n", "3", "left"}, &out, &errOut)
	require.Zero(t, code, errOut.String())
	require.NotNil(t, pool)
	require.Error(t, pool.Ping(context.Background()), "the pool is closed after Run")
}

func TestWriteJSONIndents(t *testing.T) {
	var b bytes.Buffer
	require.NoError(t, cli.WriteJSON(&b, map[string]int{"a": 1}))
	require.Equal(t, "{\n  \"a\": 1\n}\n", b.String())
}
