// Package logging builds the *slog.Logger every binary injects into its
// packages: JSON for services, text when stderr is a terminal.
package logging

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/outboxrelay/outboxrelay/internal/redact"
)

// Options select the format and level. Format is "json", "text" or "auto"
// ("" = auto: text on a terminal, JSON otherwise). Level is debug, info,
// warn or error ("" = info).
type Options struct {
	Format string
	Level  string
}

// New returns a logger writing to w. Every secret value registered with
// package redact is masked in its records.
func New(w io.Writer, opts Options) (*slog.Logger, error) {
	h, err := newHandler(w, opts)
	if err != nil {
		return nil, err
	}
	return slog.New(redact.NewHandler(h)), nil
}

func newHandler(w io.Writer, opts Options) (slog.Handler, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(cmpOr(opts.Level, "info"))); err != nil {
		return nil, fmt.Errorf("LOG_LEVEL=%q: want debug, info, warn or error", opts.Level)
	}
	ho := &slog.HandlerOptions{Level: level}
	switch strings.ToLower(cmpOr(opts.Format, "auto")) {
	case "json":
		return slog.NewJSONHandler(w, ho), nil
	case "text":
		return slog.NewTextHandler(w, ho), nil
	case "auto":
		if IsTerminal(w) {
			return slog.NewTextHandler(w, ho), nil
		}
		return slog.NewJSONHandler(w, ho), nil
	default:
		return nil, fmt.Errorf("LOG_FORMAT=%q: want json, text or auto", opts.Format)
	}
}

// IsTerminal reports whether w is a character device (a terminal).
func IsTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}
