// Package pgconn opens the PostgreSQL pool every binary uses and turns
// connection failures into one line that names DATABASE_URL with the
// password redacted.
package pgconn

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/internal/redact"
)

// Open parses url, connects and pings within 10 s. maxConns <= 0 keeps pgx's
// default.
func Open(ctx context.Context, url string, maxConns int) (*pgxpool.Pool, error) {
	if url == "" {
		return nil, fmt.Errorf("DATABASE_URL is empty (e.g. postgres://user:pass@localhost:5432/db)")
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		// pgx's parse error may quote the input; do not pass it through.
		return nil, fmt.Errorf("DATABASE_URL=%s: not a valid PostgreSQL connection string", redact.URL(url))
	}
	if maxConns > 0 {
		cfg.MaxConns = int32(maxConns)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "outboxrelay"
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(pctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL=%s: %w", redact.URL(url), err)
	}
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, &oneLineError{msg: fmt.Sprintf("DATABASE_URL=%s: cannot connect: %s", redact.URL(url), flatten(err.Error())), err: err}
	}
	return pool, nil
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
