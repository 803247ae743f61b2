// Package pgconn opens the PostgreSQL pool every binary uses and turns
// connection failures into one line that names DATABASE_URL with the
// password redacted; it also gives session advisory locks back without
// hanging on a database that stopped answering.
package pgconn

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/internal/redact"
)

// Open parses url, connects and pings within 10 s. maxConns <= 0 keeps pgx's
// default.
func Open(ctx context.Context, url string, maxConns int) (*pgxpool.Pool, error) {
	if url == "" {
		return nil, fmt.Errorf("DATABASE_URL is empty (e.g. postgres://user:pass@localhost:5432/db)")
	}
	// The passwords, as written and as pgx reads them, are masked in every
	// log line and error from now on.
	redact.AddConnString(url)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		// pgx's parse error may quote the input; do not pass it through.
		return nil, fmt.Errorf("DATABASE_URL=%s: not a valid PostgreSQL connection string", redact.URL(url))
	}
	redact.Add(cfg.ConnConfig.Password)
	if maxConns > 0 {
		cfg.MaxConns = int32(maxConns)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "outboxrelay"
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(pctx, cfg)
	if err != nil {
		return nil, &oneLineError{msg: fmt.Sprintf("DATABASE_URL=%s: %s", redact.URL(url), redact.String(err.Error())), err: err}
	}
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, ConnectError(url, err)
	}
	return pool, nil
}

// ConnectError is the error Open returns when url does not connect: one
// line naming DATABASE_URL, its passwords and every registered secret
// masked. err stays available to errors.Is and errors.As.
func ConnectError(url string, err error) error {
	return &oneLineError{msg: fmt.Sprintf("DATABASE_URL=%s: cannot connect: %s", redact.URL(url), flatten(redact.String(err.Error()))), err: err}
}

// oneLineError keeps the wrapped error for errors.Is/As but prints on one
// line (pgx lists each address it tried on a line of its own).
type oneLineError struct {
	msg string
	err error
}

func (e *oneLineError) Error() string { return e.msg }
func (e *oneLineError) Unwrap() error { return e.err }

func flatten(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

// unlockTimeout bounds [ReleaseAdvisoryLock]'s wait for the database.
const unlockTimeout = 5 * time.Second

// ReleaseAdvisoryLock gives back the session-level advisory lock key that
// conn holds, also when ctx has ended (a process that stops still gives its
// locks back). A database that does not answer within five seconds (stalled,
// or the network to it gone) gets the session closed instead: PostgreSQL
// releases a session's locks when it ends, and a stopping process does not
// hang on a database that may never answer. A conn closed here is dropped by
// its pool when released.
func ReleaseAdvisoryLock(ctx context.Context, conn *pgx.Conn, key int64) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), unlockTimeout)
	defer cancel()
	_, err := conn.Exec(ctx, `SELECT pg_advisory_unlock($1)`, key)
	if err != nil {
		_ = conn.Close(ctx)
		return fmt.Errorf("release advisory lock %d: %w (the session is closed, which releases it)", key, err)
	}
	return nil
}
