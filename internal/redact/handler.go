package redact

import (
	"context"
	"fmt"
	"io"
	"log/slog"
)

// NewHandler wraps next so that every registered secret value ([Add]) is
// masked in the message and in every attribute (strings, errors, anything
// printed with fmt, in groups too) before next formats the record.
func NewHandler(next slog.Handler) slog.Handler { return &handler{next: next} }

type handler struct{ next slog.Handler }

func (h *handler) Enabled(ctx context.Context, l slog.Level) bool { return h.next.Enabled(ctx, l) }

func (h *handler) Handle(ctx context.Context, r slog.Record) error {
	nr := slog.NewRecord(r.Time, r.Level, String(r.Message), r.PC)
	r.Attrs(func(a slog.Attr) bool {
		nr.AddAttrs(attr(a))
		return true
	})
	return h.next.Handle(ctx, nr)
}

func (h *handler) WithAttrs(as []slog.Attr) slog.Handler {
	out := make([]slog.Attr, len(as))
	for i, a := range as {
		out[i] = attr(a)
	}
	return &handler{next: h.next.WithAttrs(out)}
}

func (h *handler) WithGroup(name string) slog.Handler {
	return &handler{next: h.next.WithGroup(name)}
}

func attr(a slog.Attr) slog.Attr {
	v := a.Value.Resolve()
	switch v.Kind() {
	case slog.KindString:
		return slog.String(a.Key, String(v.String()))
	case slog.KindGroup:
		g := v.Group()
		out := make([]any, len(g))
		for i, x := range g {
			out[i] = attr(x)
		}
		return slog.Group(a.Key, out...)
	case slog.KindAny:
		var s string
		if err, ok := v.Any().(error); ok {
			s = err.Error()
		} else {
			s = fmt.Sprintf("%+v", v.Any())
		}
		if m := String(s); m != s {
			return slog.String(a.Key, m)
		}
	}
	return slog.Attr{Key: a.Key, Value: v}
}

// Writer returns w with every registered secret value masked in each
// Write (for the commands' standard output: status tables, JSON). A secret
// split across two Writes is not seen; fmt, encoding/json and
// text/tabwriter write a value (a table cell) in one Write.
func Writer(w io.Writer) io.Writer { return &writer{w: w} }

type writer struct{ w io.Writer }

func (w *writer) Write(p []byte) (int, error) {
	s := string(p)
	m := String(s)
	if m == s {
		return w.w.Write(p)
	}
	if _, err := io.WriteString(w.w, m); err != nil {
		return 0, err
	}
	return len(p), nil
}
