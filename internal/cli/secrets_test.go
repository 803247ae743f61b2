package cli_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/cli"
)

// The line a binary prints on error masks every secret its settings hold,
// also when the error quotes the password alone (as a driver might) and
// when the URL is one url.Parse misreads.
func TestDispatchErrorLineMasksSecrets(t *testing.T) {
	const dbPass, esPass = "#s3cret-db", "pa,ss-es-word"
	dir := t.TempDir()
	esFile := filepath.Join(dir, "es")
	require.NoError(t, os.WriteFile(esFile, []byte(esPass+"\n"), 0o600))
	env := map[string]string{
		"DATABASE_URL":                "postgres://relay:" + dbPass + "@db/x",
		"ELASTICSEARCH_PASSWORD_FILE": esFile,
		"METRICS_PASSWORD":            "m3trics-pw",
	}
	cmds := []cli.Command{{Name: "run", Summary: "r", Run: func(_ context.Context, args []string) error {
		var db, metrics, esFileName string
		fs := cli.NewFlagSet("x run", "")
		fs.SetLookupEnv(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
		fs.SecretOrFile(&db, "database-url", "DATABASE_URL", "db")
		fs.Secret(&metrics, "metrics-password", "METRICS_PASSWORD", "", "pw")
		fs.SecretFile(&esFileName, "elasticsearch-password-file", "ELASTICSEARCH_PASSWORD_FILE", "pw file")
		if _, err := fs.Parse(args); err != nil {
			return err
		}
		return fmt.Errorf("%s: password %q rejected; %s and %s too", db, dbPass, esPass, metrics)
	}}}
	var stdout, stderr bytes.Buffer
	code := cli.Dispatch(context.Background(), "x", "about", cmds, []string{"run"}, &stdout, &stderr)
	require.Equal(t, cli.ExitError1, code)
	out := stderr.String()
	require.Contains(t, out, "x run: ")
	for _, s := range []string{"s3cret-db", "pa,ss-es-word", "m3trics-pw"} {
		require.NotContains(t, out, s)
	}
}

// A secret given as a flag (readable by every local user in
// /proc/PID/cmdline) is a warning that points to the variable and its file
// form; the same value from the environment, or a connection string
// without a password, is not.
func TestSecretFlagWarns(t *testing.T) {
	t.Parallel()
	parse := func(env map[string]string, args ...string) *cli.FlagSet {
		var db, es, esFile, metrics string
		fs := cli.NewFlagSet("x run", "")
		fs.SetLookupEnv(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
		fs.SecretOrFile(&db, "database-url", "DATABASE_URL", "db")
		fs.Secret(&es, "elasticsearch-password", "ELASTICSEARCH_PASSWORD", "", "pw")
		fs.SecretFile(&esFile, "elasticsearch-password-file", "ELASTICSEARCH_PASSWORD_FILE", "pw file")
		fs.Secret(&metrics, "metrics-password", "METRICS_PASSWORD", "", "pw")
		_, err := fs.Parse(args)
		require.NoError(t, err)
		return fs
	}
	fs := parse(nil, "--database-url", "postgres://u:flag-s3cret@h/db", "--elasticsearch-password=flag-s3cret", "--metrics-password", "flag-s3cret")
	w := strings.Join(fs.Warnings(), "\n")
	require.Len(t, fs.Warnings(), 3, w)
	require.Contains(t, w, "--database-url is given on the command line")
	require.Contains(t, w, "set DATABASE_URL or DATABASE_URL_FILE instead")
	require.Contains(t, w, "set ELASTICSEARCH_PASSWORD or ELASTICSEARCH_PASSWORD_FILE instead")
	require.Contains(t, w, "set METRICS_PASSWORD instead")
	require.NotContains(t, w, "flag-s3cret")

	require.Empty(t, parse(map[string]string{"DATABASE_URL": "postgres://u:env-s3cret@h/db", "METRICS_PASSWORD": "env-s3cret"}).Warnings())
	require.Empty(t, parse(nil, "--database-url", "postgres://u@h/db?sslmode=verify-full").Warnings(), "no password, nothing to warn about")
}

// A secret file (*_FILE) that its group or others may read is a warning
// naming the file, never its content.
func TestSecretFilePermissionsWarn(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	write := func(name string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte("postgres://u:file-s3cret@h/db\n"), 0o600))
		require.NoError(t, os.Chmod(p, mode))
		return p
	}
	private, groupReadable, worldReadable := write("private", 0o600), write("group", 0o640), write("world", 0o644)
	for _, tc := range []struct {
		name, dbFile, esFile string
		want                 []string
	}{
		{name: "0600", dbFile: private, esFile: private},
		{name: "group-readable", dbFile: groupReadable, want: []string{`DATABASE_URL_FILE="` + groupReadable + `" is readable by its group (mode 0640)`}},
		{name: "world-readable", esFile: worldReadable, want: []string{`ELASTICSEARCH_PASSWORD_FILE="` + worldReadable + `" is readable by its group and others (mode 0644)`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := map[string]string{}
			if tc.dbFile != "" {
				env["DATABASE_URL_FILE"] = tc.dbFile
			}
			if tc.esFile != "" {
				env["ELASTICSEARCH_PASSWORD_FILE"] = tc.esFile
			}
			var db, esFile string
			fs := cli.NewFlagSet("x run", "")
			fs.SetLookupEnv(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
			fs.SecretOrFile(&db, "database-url", "DATABASE_URL", "db")
			fs.SecretFile(&esFile, "elasticsearch-password-file", "ELASTICSEARCH_PASSWORD_FILE", "pw file")
			_, err := fs.Parse(nil)
			require.NoError(t, err)
			require.Len(t, fs.Warnings(), len(tc.want))
			for i, w := range tc.want {
				require.Contains(t, fs.Warnings()[i], w)
				require.Contains(t, fs.Warnings()[i], "chmod 600")
				require.NotContains(t, fs.Warnings()[i], "file-s3cret")
			}
		})
	}
}

// The warnings reach the user: on stderr when the command built no logger.
func TestDispatchPrintsWarnings(t *testing.T) {
	cmds := []cli.Command{{Name: "run", Summary: "r", Run: func(_ context.Context, args []string) error {
		var pw string
		fs := cli.NewFlagSet("x run", "")
		fs.SetLookupEnv(func(string) (string, bool) { return "", false })
		fs.Secret(&pw, "metrics-password", "METRICS_PASSWORD", "", "pw")
		_, err := fs.Parse(args)
		return errors.Join(err)
	}}}
	var stdout, stderr bytes.Buffer
	code := cli.Dispatch(context.Background(), "x", "about", cmds, []string{"run", "--metrics-password", "warn-s3cret"}, &stdout, &stderr)
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, stderr.String(), "x run: warning: --metrics-password is given on the command line")
	require.NotContains(t, stderr.String(), "warn-s3cret")
}
