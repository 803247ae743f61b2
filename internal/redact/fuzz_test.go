package redact_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/esconn"
	"github.com/outboxrelay/outboxrelay/internal/kafkaconn"
	"github.com/outboxrelay/outboxrelay/internal/logging"
	"github.com/outboxrelay/outboxrelay/internal/pgconn"
	"github.com/outboxrelay/outboxrelay/internal/redact"
)

// FuzzRedact puts a password of any printable characters into every
// setting and every form pgx and the search client accept, runs them
// through the real printing paths (redact.URL, pgconn's connect error,
// esconn's URL errors, the CLI's settings, error line, warnings and --help,
// the services' logger) and checks the password never comes out.
//
// CI: go test -run '^$' -fuzz '^FuzzRedact$' -fuzztime 30s ./internal/redact/
//
// The seed corpus is the cases plus random passwords from a seed
// printed on stderr (REDACT_FUZZ_SEED=N replays it); a failing input found
// by the fuzz engine is written to testdata/fuzz/FuzzRedact/ and replayed
// by a plain `go test`.
func FuzzRedact(f *testing.F) {
	for _, c := range namedCases {
		f.Add(c.password)
	}
	for _, pw := range []string{
		"p@ss#w?rd/:,", `a'b c\`, "x://y,z", "a,https://b", "  ", "ü€ß🔑 pa ss", `"quoted"`, "password=x", "&sslmode=disable",
		"%41%zz", "xxxxx", "relay", "@db/x", "s3cret-@-@", `\'\\`, "123?", "#", "?", "a&b=c",
	} {
		f.Add(pw)
	}
	seed := time.Now().UnixNano()
	if s := os.Getenv("REDACT_FUZZ_SEED"); s != "" {
		var err error
		if seed, err = strconv.ParseInt(s, 10, 64); err != nil {
			f.Fatalf("REDACT_FUZZ_SEED=%q: %v", s, err)
		}
	}
	fmt.Fprintf(os.Stderr, "FuzzRedact: random seed corpus from seed %d (replay with REDACT_FUZZ_SEED=%d)\n", seed, seed)
	rng := rand.New(rand.NewSource(seed))
	for range 24 {
		f.Add(randomPassword(rng))
	}

	f.Fuzz(func(t *testing.T, pw string) {
		pw = printable(pw)
		if pw == "" {
			return
		}
		other := placeholder(pw)
		// Shape-based masking alone, nothing registered: every form, any
		// length.
		redact.Reset()
		for _, form := range forms {
			mustNotShow(t, "redact.URL("+form.name+")", pw, other, func(pw string) string { return redact.URL(form.render(pw)) })
			mustNotShow(t, "pgconn.ConnectError("+form.name+")", pw, other, func(pw string) string {
				return pgconn.ConnectError(form.render(pw), errors.New("dial tcp 10.0.0.1:5432: connect: connection refused")).Error()
			})
		}
		for _, form := range esForms {
			mustNotShow(t, "esconn.Build("+form.name+")", pw, other, func(pw string) string { return esBuild(form.render(pw)) })
		}
		// The whole process: settings read from the environment, *_FILE
		// files and flags, then everything a run prints. Registered values
		// shorter than redact.MinLen are not masked where they occur alone.
		if len(pw) < redact.MinLen {
			return
		}
		mustNotShow(t, "a run's output", pw, other, func(pw string) string {
			redact.Reset()
			return runProcess(t, pw)
		})
	})
}

// A form puts a password into a connection string as a user would write it.
type form struct {
	name   string
	render func(pw string) string
}

var forms = []form{
	{"URL", func(pw string) string { return "postgres://relay:" + pw + "@db:5432/x?sslmode=verify-full" }},
	{"URL, escaped", func(pw string) string { return "postgres://" + url.UserPassword("relay", pw).String() + "@db/x" }},
	{"URL, password param", func(pw string) string {
		return "postgres://relay@db/x?sslmode=require&password=" + url.QueryEscape(pw) + "&application_name=a"
	}},
	{"URL, sslpassword param", func(pw string) string {
		return "postgres://relay@db/x?sslpassword=" + strings.ReplaceAll(pw, "&", "%26") + "&sslmode=verify-full"
	}},
	{"multi-host URL", func(pw string) string { return "postgres://relay:" + pw + "@h1:5432,h2:5433/x" }},
	{"key=value, quoted", func(pw string) string { return "host=db user=relay password='" + kvQuote(pw) + "' dbname=x" }},
	{"key=value, unquoted", func(pw string) string { return "host=db password=" + kvUnquoted(pw) + " dbname=x" }},
	{"key=value, sslpassword", func(pw string) string { return "sslpassword='" + kvQuote(pw) + "' sslmode=verify-full host=db" }},
	{"search URL", func(pw string) string { return "https://elastic:" + pw + "@es1:9200" }},
	{"search URLs", func(pw string) string {
		return "https://elastic:" + pw + "@es1:9200,https://elastic:" + pw + "@es2:9200"
	}},
}

var esForms = []form{forms[8], forms[9], {"search URLs, user info once", func(pw string) string {
	return "http://es0:9200, https://elastic:" + url.PathEscape(pw) + "@es1:9200"
}}}

// esBuild is what esconn.Build prints: its error, or the URL it keeps.
func esBuild(raw string) string {
	conn, err := esconn.Settings{}.Build(raw)
	if err != nil {
		return err.Error()
	}
	return conn.URL
}

// runProcess reads the settings as a binary does (environment, *_FILE
// files, a secret flag) through cli.Dispatch and returns all it printed:
// the error line and warnings (stderr), a service's log lines, --help and
// standard output.
func runProcess(t *testing.T, pw string) string {
	dir := t.TempDir()
	dbFile := filepath.Join(dir, "database-url")
	esFile := filepath.Join(dir, "es-password")
	if err := os.WriteFile(dbFile, []byte("host=db user=relay password='"+kvQuote(pw)+"' dbname=x\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(esFile, []byte(pw+"\n"), 0o640); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{
		"DATABASE_URL_FILE":           dbFile,
		"ELASTICSEARCH_URL":           "https://elastic:" + pw + "@es1:9200,https://elastic:" + pw + "@es2:9200",
		"ELASTICSEARCH_PASSWORD_FILE": esFile,
		"KAFKA_SASL_MECHANISM":        "PLAIN",
		"KAFKA_SASL_USERNAME":         "relay",
		"KAFKA_SASL_PASSWORD":         pw,
	}
	var logs, help, stdout, stderr bytes.Buffer
	w := redact.Writer(&stdout)
	cmd := cli.Command{Name: "run", Summary: "r", Run: func(_ context.Context, args []string) error {
		var c cli.Common
		var esURL, metricsPW string
		var es esconn.Settings
		var ks kafkaconn.Settings
		fs := cli.NewFlagSet("x run", "")
		fs.SetLookupEnv(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
		c.RegisterDatabase(fs)
		fs.SecretOrFile(&esURL, "elasticsearch-url", "ELASTICSEARCH_URL", "search engine URL")
		es.Register(fs)
		ks.Register(fs)
		fs.Secret(&metricsPW, "metrics-password", "METRICS_PASSWORD", "", "metrics password")
		if _, err := fs.Parse(args); err != nil {
			return err
		}
		fs.PrintUsage(&help)
		logger, err := logging.New(&logs, logging.Options{Format: "json"})
		if err != nil {
			return err
		}
		for _, wn := range fs.Warnings() {
			logger.Warn(wn)
		}
		// Mistakes a careless caller could make: log or print the values.
		logger.Error("cannot connect "+c.DatabaseURL, "url", esURL, "password", pw, "error", errors.New("auth failed for "+pw))
		fmt.Fprintf(w, "status: %s %q\n", metricsPW, pw)
		_, esErr := es.Build(esURL)
		_, kErr := ks.Build(logger)
		return errors.Join(pgconn.ConnectError(c.DatabaseURL, errors.New("password "+strconv.Quote(pw)+" rejected")), esErr, kErr,
			fmt.Errorf("a driver's error quoting the password: %s", pw))
	}}
	code := cli.Dispatch(context.Background(), "x", "about", []cli.Command{cmd}, []string{"run", "--metrics-password", pw}, &stdout, &stderr)
	if code == cli.ExitOK {
		t.Fatalf("the run should fail (it returns the connect error); stderr: %s", stderr.String())
	}
	return stderr.String() + "\n" + dropTimes(logs.String()) + "\n" + help.String() + "\n" + stdout.String()
}

var timeRE = regexp.MustCompile(`"time":"[^"]*",`)

// dropTimes removes the log lines' timestamps, which differ between the run
// and its skeleton.
func dropTimes(s string) string { return timeRE.ReplaceAllString(s, "") }

// mustNotShow fails when print(pw) shows pw (as is, JSON- or Go-quoted),
// unless print(other) (the skeleton: the same output with another password
// that takes the same paths) shows it too: then pw is a part of the text
// that is not secret ("relay", "xxxxx", "#").
func mustNotShow(t *testing.T, what, pw, other string, print func(string) string) {
	t.Helper()
	out := print(pw)
	j, _ := json.Marshal(pw)
	q := strconv.Quote(pw)
	for _, shown := range []string{pw, string(j[1 : len(j)-1]), q[1 : len(q)-1]} {
		if strings.Contains(out, shown) && !strings.Contains(print(other), shown) {
			t.Fatalf("%s shows the password %q as %q:\n%s", what, pw, shown, out)
		}
	}
}

// printable keeps pw's printable characters (space included).
func printable(pw string) string {
	return strings.Map(func(r rune) rune {
		if r == unicode.ReplacementChar || !unicode.IsPrint(r) {
			return -1
		}
		return r
	}, pw)
}

// placeholder is another password that takes the same paths: pw's ASCII
// punctuation and spaces (the delimiters of URLs and key=value strings)
// kept, every other character replaced by a letter pw does not hold.
func placeholder(pw string) string {
	letter := '\u2603'
	for _, r := range "QZqzJKjk" {
		if !strings.ContainsRune(pw, r) {
			letter = r
			break
		}
	}
	return strings.Map(func(r rune) rune {
		if r < unicode.MaxASCII && (unicode.IsPunct(r) || unicode.IsSymbol(r) || r == ' ') {
			return r
		}
		return letter
	}, pw)
}

// kvQuote escapes pw for a single-quoted libpq value.
func kvQuote(pw string) string { return strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(pw) }

// kvUnquoted escapes pw for an unquoted libpq value.
func kvUnquoted(pw string) string {
	s := strings.NewReplacer(`\`, `\\`, ` `, `\ `).Replace(pw)
	if strings.HasPrefix(s, "'") {
		s = `\` + s
	}
	return s
}

// randomPassword is 1 to 24 printable characters, mostly ASCII (with the
// URL and libpq delimiters often), some not.
func randomPassword(rng *rand.Rand) string {
	const delims = `#?@/:,'\ &=%"`
	var b strings.Builder
	for range 1 + rng.Intn(24) {
		switch n := rng.Intn(10); {
		case n < 3:
			b.WriteByte(delims[rng.Intn(len(delims))])
		case n < 9:
			b.WriteByte(byte(' ' + rng.Intn(95)))
		default:
			for {
				r := rune(0xa0 + rng.Intn(0x2000))
				if unicode.IsPrint(r) {
					b.WriteRune(r)
					break
				}
			}
		}
	}
	return b.String()
}
