// Package migrate applies outboxrelay's embedded SQL migrations.
//
// It is a small runner in the style of river's rivermigrate rather than a
// general tool: every NNN_name.up.sql file of [migrations.FS] is applied in
// version order, each in its own transaction, and recorded in
// outboxrelay_migrations. A session-level advisory lock serialises concurrent
// runners, so two processes that migrate at once apply every file once.
//
// A dependency such as tern would bring its own file format and version
// table; the runner here is short enough to read in one sitting and keeps
// the files plain SQL.
package migrate

import (
	"context"
	"fmt"
	"io/fs"
	"log/slog"
	"regexp"
	"sort"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/internal/pgconn"
	"github.com/outboxrelay/outboxrelay/migrations"
)

// lockKey is the advisory lock every runner takes ("outboxrelay" folded to
// an int64); it only has to differ from the locks the application takes.
const lockKey int64 = 0x6f7574626f78

// Migration is one numbered SQL file.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

var fileRE = regexp.MustCompile(`^(\d{3,})_([a-z0-9_]+)\.up\.sql$`)

// All returns the embedded migrations in version order.
func All() ([]Migration, error) {
	return load(migrations.FS)
}

func load(fsys fs.FS) ([]Migration, error) {
	entries, err := fs.ReadDir(fsys, ".")
	if err != nil {
		return nil, fmt.Errorf("read migrations: %w", err)
	}
	var out []Migration
	seen := map[int]string{}
	for _, e := range entries {
		m := fileRE.FindStringSubmatch(e.Name())
		if m == nil {
			continue
		}
		v, _ := strconv.Atoi(m[1])
		if prev, dup := seen[v]; dup {
			return nil, fmt.Errorf("migrations %s and %s share version %d", prev, e.Name(), v)
		}
		seen[v] = e.Name()
		body, err := fs.ReadFile(fsys, e.Name())
		if err != nil {
			return nil, fmt.Errorf("read migration %s: %w", e.Name(), err)
		}
		out = append(out, Migration{Version: v, Name: m[2], SQL: string(body)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// Result says what [Up] did.
type Result struct {
	Applied []Migration // applied by this call, in order
	Current int         // schema version afterwards
}

// Up applies every migration not yet recorded. Safe to call from several
// processes at once.
func Up(ctx context.Context, pool *pgxpool.Pool, logger *slog.Logger) (Result, error) {
	all, err := All()
	if err != nil {
		return Result{}, err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return Result{}, fmt.Errorf("acquire connection: %w", err)
	}
	defer conn.Release()

	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, lockKey); err != nil {
		return Result{}, fmt.Errorf("take migration lock: %w", err)
	}
	// Given back also when ctx has ended, and bounded: an unlock the
	// database does not answer closes the session instead, so the pool
	// never gets back a connection that still holds the lock.
	defer func() { _ = pgconn.ReleaseAdvisoryLock(ctx, conn.Conn(), lockKey) }()

	if _, err := conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS outboxrelay_migrations (
		version    integer PRIMARY KEY,
		name       text NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return Result{}, fmt.Errorf("create outboxrelay_migrations: %w", err)
	}
	applied := map[int]bool{}
	rows, err := conn.Query(ctx, `SELECT version FROM outboxrelay_migrations`)
	if err != nil {
		return Result{}, fmt.Errorf("read applied migrations: %w", err)
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return Result{}, fmt.Errorf("read applied migrations: %w", err)
	}
	res := Result{}
	for _, v := range versions {
		applied[int(v)] = true
		res.Current = max(res.Current, int(v))
	}
	for _, m := range all {
		if applied[m.Version] {
			continue
		}
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO outboxrelay_migrations (version, name) VALUES ($1, $2)`, m.Version, m.Name)
			return err
		})
		if err != nil {
			return res, fmt.Errorf("apply migration %03d_%s: %w", m.Version, m.Name, err)
		}
		if logger != nil {
			logger.InfoContext(ctx, "migration applied", slog.Int("version", m.Version), slog.String("name", m.Name))
		}
		res.Applied = append(res.Applied, m)
		res.Current = m.Version
	}
	return res, nil
}
