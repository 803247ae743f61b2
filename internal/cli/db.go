package cli

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/internal/pgconn"
)

// DBCommand is a sub-command that works on the database only: it parses
// DATABASE_URL and the command's own settings, checks them, opens a pool,
// runs and closes the pool. Bad settings exit 2 before anything connects.
type DBCommand struct {
	// Name is the sub-command ("status", "dead-letter list").
	Name, Summary string
	// Synopsis is shown under the usage line of --help.
	Synopsis string
	// Conns is the pool's size. Default 2.
	Conns int
	// Logging adds LOG_FORMAT and LOG_LEVEL; DB.Logger is built from them.
	// Without it DB.Logger is slog.Default().
	Logging bool
	// Flags binds the command's own settings.
	Flags func(fs *FlagSet)
	// Check validates the parsed settings before the pool is opened
	// (return UsageError for the caller's mistakes). Optional.
	Check func() error
	// Run does the work with the open pool.
	Run func(ctx context.Context, db DB) error
}

// DB is what a [DBCommand]'s Run gets.
type DB struct {
	Pool   *pgxpool.Pool
	Logger *slog.Logger
	// Args are the arguments left after the flags.
	Args []string
}

// Command returns the sub-command of binary.
func (d DBCommand) Command(binary string) Command {
	return Command{Name: d.Name, Summary: d.Summary, Run: func(ctx context.Context, args []string) error {
		var c Common
		fs := NewFlagSet(binary+" "+d.Name, d.Synopsis)
		c.RegisterDatabase(fs)
		if d.Logging {
			c.RegisterLogging(fs)
		}
		if d.Flags != nil {
			d.Flags(fs)
		}
		rest, err := fs.Parse(args)
		if err != nil {
			return err
		}
		if d.Check != nil {
			if err := d.Check(); err != nil {
				return err
			}
		}
		logger := slog.Default()
		if d.Logging {
			if logger, err = c.Logger(); err != nil {
				return err
			}
		}
		pool, err := c.OpenDB(ctx, d.Conns)
		if err != nil {
			return err
		}
		defer pool.Close()
		return d.Run(ctx, DB{Pool: pool, Logger: logger, Args: rest})
	}}
}

// OpenDB opens a pool of conns connections (default 2) on DatabaseURL. A
// connection that does not verify the server is refused under REQUIRE_TLS,
// and logged as a warning when its host is not loopback.
func (c *Common) OpenDB(ctx context.Context, conns int) (*pgxpool.Pool, error) {
	if c.DatabaseURL == "" {
		return nil, errors.New("DATABASE_URL is empty: set --database-url or DATABASE_URL (e.g. postgres://user:pass@localhost:5432/db)")
	}
	if conns <= 0 {
		conns = 2
	}
	warning, err := pgconn.CheckTLS(c.DatabaseURL, c.requireTLS != nil && *c.requireTLS)
	if err != nil {
		return nil, &ExitError{Code: ExitUsage, Err: err}
	}
	if warning != "" {
		if logger, err := c.Logger(); err == nil {
			logger.Warn(warning)
		}
	}
	return pgconn.Open(ctx, c.DatabaseURL, conns)
}

// WriteJSON is how every --json and status output is printed: indented
// two spaces, one value, a newline at the end.
func WriteJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
