package redact_test

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/redact"
)

// A registered secret is masked wherever it occurs, also escaped as a URL,
// a Go quoted string or a key=value string would show it.
func TestStringMasksRegisteredValues(t *testing.T) {
	t.Cleanup(redact.Reset)
	redact.Reset()
	const secret = `p@ss "wo'rd"/#?`
	require.Equal(t, "x "+secret, redact.String("x "+secret), "nothing registered yet")
	redact.Add(secret, "abc") // too short to register
	for _, s := range []string{
		"error: " + secret + " rejected",
		"DATABASE_URL=" + strconv.Quote(secret),
		"https://u:" + url.QueryEscape(secret) + "@h",
		url.UserPassword("u", secret).String(),
		`password='` + `p@ss "wo\'rd"/#?` + `'`,
	} {
		got := redact.String(s)
		require.NotContains(t, got, "wo'rd", s)
		require.NotContains(t, got, `wo\'rd`, s)
		require.NotContains(t, got, "wo%27rd", s)
		require.Contains(t, got, redact.Mask, s)
	}
	require.Equal(t, "abc", redact.String("abc"))
}

// The passwords of a connection string, as written and unescaped, are
// registered by AddConnString, so an error quoting only the password is
// masked too.
func TestAddConnString(t *testing.T) {
	t.Cleanup(redact.Reset)
	for _, c := range namedCases {
		t.Run(c.name, func(t *testing.T) {
			redact.Reset()
			redact.AddConnString(c.in)
			got := redact.String("pgx said: " + c.password + " is wrong")
			require.NotContains(t, got, c.password)
		})
	}
	redact.Reset()
	redact.AddConnString("postgres://relay:p%40ss%23word@db/x")
	require.Equal(t, "bad: xxxxx", redact.String("bad: p@ss#word"))
}

// Every log record goes through the registry: message, string attributes,
// errors, groups and attributes added with With.
func TestHandlerMasksLogRecords(t *testing.T) {
	t.Cleanup(redact.Reset)
	redact.Reset()
	const secret = "hunter2-#?s3cret"
	redact.Add(secret)
	for _, format := range []string{"json", "text"} {
		var buf bytes.Buffer
		var h slog.Handler = slog.NewJSONHandler(&buf, nil)
		if format == "text" {
			h = slog.NewTextHandler(&buf, nil)
		}
		l := slog.New(redact.NewHandler(h)).With("dsn", "postgres://u:"+secret+"@h")
		l.Warn("cannot connect with "+secret,
			slog.String("url", "https://u:"+secret+"@h"),
			slog.Any("error", fmt.Errorf("wrapped: %w", errors.New("bad password "+secret))),
			slog.Group("g", slog.String("p", secret)),
			slog.Any("list", []string{secret}),
			slog.Int("n", 3))
		out := buf.String()
		require.NotContains(t, out, "s3cret", format)
		require.Contains(t, out, "cannot connect with "+redact.Mask, format)
		require.Contains(t, out, "wrapped: bad password "+redact.Mask, format)
	}
}

// The commands' standard output (status tables, JSON) masks registered
// secrets too.
func TestWriterMasks(t *testing.T) {
	t.Cleanup(redact.Reset)
	redact.Reset()
	var buf bytes.Buffer
	w := redact.Writer(&buf)
	n, err := fmt.Fprintf(w, "error: %s\n", "st4tus-s3cret")
	require.NoError(t, err)
	require.Equal(t, len("error: st4tus-s3cret\n"), n)
	redact.Add("st4tus-s3cret")
	n, err = fmt.Fprintf(w, "error: %s\n", "st4tus-s3cret")
	require.NoError(t, err)
	require.Equal(t, len("error: st4tus-s3cret\n"), n)
	require.Equal(t, "error: st4tus-s3cret\nerror: xxxxx\n", buf.String())
}
