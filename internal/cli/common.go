package cli

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/outboxrelay/outboxrelay/internal/logging"
	"github.com/outboxrelay/outboxrelay/internal/migrate"
)

// Common holds the settings every binary shares.
type Common struct {
	// DatabaseURL is the PostgreSQL connection string. Required by commands
	// that touch the database.
	DatabaseURL string
	// LogFormat is json, text or auto (default auto: text on a terminal).
	LogFormat string
	// LogLevel is debug, info, warn or error (default info).
	LogLevel string
	// requireTLS is REQUIRE_TLS (see [FlagSet.RequireTLS]); nil: false.
	requireTLS *bool
}

// RegisterDatabase adds --database-url / DATABASE_URL and its file form
// --database-url-file / DATABASE_URL_FILE (the URL may hold a password),
// and REQUIRE_TLS.
func (c *Common) RegisterDatabase(fs *FlagSet) {
	fs.SecretOrFile(&c.DatabaseURL, "database-url", "DATABASE_URL", "PostgreSQL connection string, e.g. postgres://user:pass@localhost:5432/db (required)")
	c.BindRequireTLS(fs)
}

// BindRequireTLS makes OpenDB follow fs's REQUIRE_TLS (for a command that
// registers DATABASE_URL itself).
func (c *Common) BindRequireTLS(fs *FlagSet) { c.requireTLS = fs.RequireTLS() }

// RegisterLogging adds --log-format and --log-level.
func (c *Common) RegisterLogging(fs *FlagSet) {
	fs.String(&c.LogFormat, "log-format", "LOG_FORMAT", "auto", "log format: json, text or auto (text on a terminal, JSON otherwise)")
	fs.String(&c.LogLevel, "log-level", "LOG_LEVEL", "info", "log level: debug, info, warn or error")
}

// Logger builds the logger on stderr (it masks every secret registered with
// package redact) and logs the settings' warnings with it.
func (c *Common) Logger() (*slog.Logger, error) {
	l, err := logging.New(os.Stderr, logging.Options{Format: c.LogFormat, Level: c.LogLevel})
	if err != nil {
		return nil, UsageError("%v", err)
	}
	for _, w := range takeWarnings() {
		l.Warn(w)
	}
	return l, nil
}

// MigrateCommand is the `migrate` sub-command every binary has.
func MigrateCommand(binary string, stdout io.Writer) Command {
	return DBCommand{
		Name:     "migrate",
		Summary:  "apply the embedded SQL migrations (safe to run from several processes at once)",
		Synopsis: "Applies every migration not yet recorded in outboxrelay_migrations, each in its own\ntransaction, under an advisory lock.",
		Logging:  true,
		Run: func(ctx context.Context, db DB) error {
			res, err := migrate.Up(ctx, db.Pool, db.Logger)
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "schema at version %d (%d migration(s) applied now)\n", res.Current, len(res.Applied))
			return nil
		},
	}.Command(binary)
}
