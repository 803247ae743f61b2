package cli_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/redact"
)

func TestFlagSetEnvThenFlags(t *testing.T) {
	t.Parallel()
	env := map[string]string{"BATCH_SIZE": "500", "POLL": "2s", "NAME": "from-env"}
	var size int
	var poll time.Duration
	var name string
	fs := cli.NewFlagSet("x run", "")
	fs.SetLookupEnv(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	fs.Int(&size, "batch-size", "BATCH_SIZE", 100, "rows per batch")
	fs.Duration(&poll, "poll", "POLL", time.Second, "poll interval")
	fs.String(&name, "name", "NAME", "def", "a name")
	rest, err := fs.Parse([]string{"--name", "from-flag", "extra"})
	require.NoError(t, err)
	require.Equal(t, 500, size)
	require.Equal(t, 2*time.Second, poll)
	require.Equal(t, "from-flag", name, "a flag beats the environment")
	require.Equal(t, []string{"extra"}, rest)
}

func TestFlagSetBadEnvNamesTheVariable(t *testing.T) {
	t.Parallel()
	var size int
	fs := cli.NewFlagSet("x run", "")
	fs.SetLookupEnv(func(k string) (string, bool) { return "lots", k == "BATCH_SIZE" })
	fs.Int(&size, "batch-size", "BATCH_SIZE", 100, "rows per batch")
	_, err := fs.Parse(nil)
	require.EqualError(t, err, `BATCH_SIZE="lots": want an integer`)
	var ee *cli.ExitError
	require.True(t, errors.As(err, &ee))
	require.Equal(t, cli.ExitUsage, ee.Code)
}

// A secret given as NAME or as the file NAME_FILE names (a Docker or
// Kubernetes secret, surrounding whitespace dropped); both, an unreadable or
// an empty file is an error naming the variables, never the secret.
func TestFlagSetSecretOrFile(t *testing.T) {
	t.Parallel()
	const secret = "postgres://app:s3cret@db:5432/app"
	dir := t.TempDir()
	file := filepath.Join(dir, "url")
	require.NoError(t, os.WriteFile(file, []byte(secret+"\n\n"), 0o600))
	empty := filepath.Join(dir, "empty")
	require.NoError(t, os.WriteFile(empty, []byte("\n"), 0o600))
	for _, tc := range []struct {
		name    string
		env     map[string]string
		args    []string
		want    string
		wantErr string
	}{
		{name: "value", env: map[string]string{"DATABASE_URL": secret}, want: secret},
		{name: "file", env: map[string]string{"DATABASE_URL_FILE": file}, want: secret},
		{name: "file flag", args: []string{"--database-url-file", file}, want: secret},
		{name: "neither", want: ""},
		{name: "both", env: map[string]string{"DATABASE_URL": secret, "DATABASE_URL_FILE": file}, wantErr: "DATABASE_URL and DATABASE_URL_FILE are both set: set one"},
		{name: "missing file", env: map[string]string{"DATABASE_URL_FILE": filepath.Join(dir, "nope")}, wantErr: `DATABASE_URL_FILE="` + filepath.Join(dir, "nope") + `": open`},
		{name: "empty file", env: map[string]string{"DATABASE_URL_FILE": empty}, wantErr: `DATABASE_URL_FILE="` + empty + `": the file is empty`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var url string
			fs := cli.NewFlagSet("x run", "")
			fs.SetLookupEnv(func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok })
			fs.SecretOrFile(&url, "database-url", "DATABASE_URL", "connection string")
			_, err := fs.Parse(tc.args)
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				require.NotContains(t, err.Error(), "s3cret")
				var ee *cli.ExitError
				require.ErrorAs(t, err, &ee)
				require.Equal(t, cli.ExitUsage, ee.Code)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, url)
		})
	}
	var url string
	fs := cli.NewFlagSet("x run", "")
	fs.SecretOrFile(&url, "database-url", "DATABASE_URL", "connection string")
	var help bytes.Buffer
	fs.PrintUsage(&help)
	require.Contains(t, help.String(), "--database-url-file  (env DATABASE_URL_FILE")
}

func TestDispatch(t *testing.T) {
	t.Parallel()
	var ran string
	cmds := []cli.Command{
		{Name: "quarantine", Summary: "q", Run: func(context.Context, []string) error { ran = "quarantine"; return nil }},
		{Name: "quarantine list", Summary: "ql", Run: func(_ context.Context, args []string) error { ran = "list " + args[0]; return nil }},
		{Name: "fail", Summary: "f", Run: func(context.Context, []string) error {
			return &cli.ExitError{Code: cli.ExitConflict, Err: errors.New("conflict")}
		}},
	}
	for _, tc := range []struct {
		name     string
		args     []string
		code     int
		ran, err string
	}{
		{name: "longest match", args: []string{"quarantine", "list", "--job", "j"}, ran: "list --job"},
		{name: "short", args: []string{"quarantine"}, ran: "quarantine"},
		{name: "exit code", args: []string{"fail"}, code: cli.ExitConflict, err: "x fail: conflict\n"},
		{name: "unknown", args: []string{"nope"}, code: cli.ExitUsage},
		{name: "help", args: []string{"--help"}},
	} {
		ran = ""
		var stdout, stderr bytes.Buffer
		code := cli.Dispatch(context.Background(), "x", "about", cmds, tc.args, &stdout, &stderr)
		require.Equal(t, tc.code, code, tc.name)
		require.Equal(t, tc.ran, ran, tc.name)
		if tc.err != "" {
			require.Equal(t, tc.err, stderr.String(), tc.name)
		}
	}
}

func TestRedact(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, in, want string }{
		{"url", "postgres://app:s3cret@db:5432/app?sslmode=disable", "postgres://app:xxxxx@db:5432/app?sslmode=disable"},
		{"url without password", "postgres://app@db/app", "postgres://app@db/app"},
		{"query password", "postgres://db/app?password=s3cret", "postgres://db/app?password=xxxxx"},
		{"key value", "host=db user=app password=s3cret dbname=app", "host=db user=app password=xxxxx dbname=app"},
		{"http", "http://elastic:changeme@es:9200", "http://elastic:xxxxx@es:9200"},
		// Not well-formed URLs: the password must not come back either.
		{"unescaped # in the password", "https://relay:p#ss@es:9200", "https://relay:xxxxx@es:9200"},
		{"unescaped / and @ in the password", "postgres://app:a/b@c@db:5432/app", "postgres://app:xxxxx@db:5432/app"},
		{"trailing newline", "https://relay:s3cret@es:9200\n", "https://relay:xxxxx@es:9200\n"},
		{"in an error message", `parse "postgres://app:p?ss@db/app": invalid`, `parse "postgres://app:xxxxx@db/app": invalid`},
	} {
		require.Equal(t, tc.want, redact.URL(tc.in), tc.name)
	}
}
