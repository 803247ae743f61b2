package stack

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/internal/migrate"
)

// ServerURL returns the URL of the shared PostgreSQL server's maintenance
// database. Most tests want [Database] instead.
func ServerURL(tb testing.TB) string {
	tb.Helper()
	return sharedEnv(tb, "postgres")
}

var templates sync.Map // server URL -> *templateOnce

type templateOnce struct {
	once sync.Once
	name string
	err  error
}

// Database creates a fresh, migrated database for this test on the shared
// server and returns its URL. Committed rows are visible to every
// connection, so the test can read with a new connection what a killed
// process wrote. The database is dropped when the test ends.
func Database(tb testing.TB) string {
	tb.Helper()
	base := ServerURL(tb)
	tmpl, err := migratedTemplate(base)
	if err != nil {
		tb.Fatalf("prepare template database: %v", err)
	}
	name := strings.ReplaceAll(UniqueName("test"), "-", "_")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := adminExec(ctx, base, func(conn *pgx.Conn) error {
		return retryBusy(ctx, func() error {
			_, err := conn.Exec(ctx, fmt.Sprintf("CREATE DATABASE %s TEMPLATE %s",
				pgx.Identifier{name}.Sanitize(), pgx.Identifier{tmpl}.Sanitize()))
			return err
		})
	}); err != nil {
		tb.Fatalf("create test database: %v", err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_ = adminExec(ctx, base, func(conn *pgx.Conn) error {
			_, err := conn.Exec(ctx, fmt.Sprintf("DROP DATABASE IF EXISTS %s WITH (FORCE)", pgx.Identifier{name}.Sanitize()))
			return err
		})
	})
	return WithDatabase(base, name)
}

// Pool opens a pool on url that is closed when the test ends.
func Pool(tb testing.TB, url string) *pgxpool.Pool {
	tb.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		tb.Fatalf("open pool: %v", err)
	}
	tb.Cleanup(pool.Close)
	return pool
}

// WithDatabase returns url pointing at database name.
func WithDatabase(base, name string) string {
	u, err := url.Parse(base)
	if err != nil {
		panic(err)
	}
	u.Path = "/" + name
	return u.String()
}

// migratedTemplate creates, once per server and schema version, a database
// with every migration applied; test databases are copied from it. Several
// test binaries share a server, so creation is serialised by an advisory
// lock and the name carries a hash of the migrations.
func migratedTemplate(base string) (string, error) {
	v, _ := templates.LoadOrStore(base, &templateOnce{})
	t := v.(*templateOnce)
	t.once.Do(func() {
		all, err := migrate.All()
		if err != nil {
			t.err = err
			return
		}
		h := sha256.New()
		for _, m := range all {
			fmt.Fprintf(h, "%d %s\n%s\n", m.Version, m.Name, m.SQL)
		}
		t.name = "outboxrelay_tmpl_" + hex.EncodeToString(h.Sum(nil))[:12]
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		t.err = adminExec(ctx, base, func(conn *pgx.Conn) error {
			if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock(7426)`); err != nil {
				return err
			}
			defer conn.Exec(context.Background(), `SELECT pg_advisory_unlock(7426)`)
			var exists bool
			if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1 AND datistemplate)`, t.name).Scan(&exists); err != nil {
				return err
			}
			if exists {
				return nil
			}
			_, _ = conn.Exec(ctx, fmt.Sprintf("DROP DATABASE IF EXISTS %s WITH (FORCE)", pgx.Identifier{t.name}.Sanitize()))
			if _, err := conn.Exec(ctx, fmt.Sprintf("CREATE DATABASE %s", pgx.Identifier{t.name}.Sanitize())); err != nil {
				return err
			}
			pool, err := pgxpool.New(ctx, WithDatabase(base, t.name))
			if err != nil {
				return err
			}
			_, err = migrate.Up(ctx, pool, nil)
			pool.Close()
			if err != nil {
				return err
			}
			_, err = conn.Exec(ctx, fmt.Sprintf("ALTER DATABASE %s WITH is_template = true", pgx.Identifier{t.name}.Sanitize()))
			return err
		})
	})
	return t.name, t.err
}

func adminExec(ctx context.Context, base string, fn func(*pgx.Conn) error) error {
	conn, err := pgx.Connect(ctx, base)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return fn(conn)
}

// retryBusy retries CREATE DATABASE while another session copies the same
// template ("source database is being accessed by other users").
func retryBusy(ctx context.Context, fn func() error) error {
	for {
		err := fn()
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || pgErr.Code != "55006" { // object_in_use
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(50 * time.Millisecond):
		}
	}
}
