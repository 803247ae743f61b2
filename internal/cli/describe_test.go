package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/cli"
)

// `<binary> __settings` lists every command's settings as JSON without
// running the command (nothing after Parse happens, the environment is not
// read) and is not listed in the help.
func TestSettingsCommandDescribesWithoutRunning(t *testing.T) {
	ran := false
	cmds := []cli.Command{{Name: "sync all", Summary: "sync", Run: func(_ context.Context, args []string) error {
		var db string
		var n int
		var d time.Duration
		var dry bool
		fs := cli.NewFlagSet("x sync all", "Syncs.")
		// A variable that does not parse would fail a real Parse.
		fs.SetLookupEnv(func(k string) (string, bool) { return "not-a-number", k == "N" })
		fs.SecretOrFile(&db, "database-url", "DATABASE_URL", "the database")
		fs.Int(&n, "n", "N", 7, "how many")
		fs.Duration(&d, "wait", "WAIT", 1500*time.Millisecond, "how long")
		fs.Bool(&dry, "dry", "", false, "only say")
		if _, err := fs.Parse(args); err != nil {
			return err
		}
		ran = true
		return nil
	}}}
	var stdout, stderr bytes.Buffer
	code := cli.Dispatch(context.Background(), "x", "about x", cmds, []string{cli.SettingsCommand}, &stdout, &stderr)
	require.Equal(t, cli.ExitOK, code, stderr.String())
	require.False(t, ran, "the command ran")
	var b cli.Binary
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &b))
	require.Equal(t, cli.Binary{Name: "x", About: "about x", Commands: []cli.DescribedCommand{{
		Name: "sync all", Summary: "sync", Synopsis: "Syncs.",
		Settings: []cli.DescribedSetting{
			{Flag: "database-url", Env: "DATABASE_URL", Kind: "string", Usage: "the database", Secret: true, FileFlag: "database-url-file"},
			{Flag: "database-url-file", Env: "DATABASE_URL_FILE", Kind: "string", Usage: "file holding --database-url (instead of DATABASE_URL)", SecretFile: true, FileOf: "database-url"},
			{Flag: "dry", Default: "false", Kind: "boolean", Usage: "only say"},
			{Flag: "n", Env: "N", Default: "7", Kind: "integer", Usage: "how many"},
			{Flag: "wait", Env: "WAIT", Default: "1.5s", Kind: "duration", Usage: "how long"},
		},
	}}}, b)

	stdout.Reset()
	require.Equal(t, cli.ExitOK, cli.Dispatch(context.Background(), "x", "about x", cmds, []string{"--help"}, &stdout, &stderr))
	require.NotContains(t, stdout.String(), cli.SettingsCommand)

	// After describing, Parse reads the environment again.
	require.EqualError(t, cmds[0].Run(context.Background(), nil), `N="not-a-number": want an integer`)
}

// A command whose settings cannot be listed (it parses no FlagSet) is an
// error, not a command without settings.
func TestDescribeRefusesACommandWithoutFlagSet(t *testing.T) {
	cmds := []cli.Command{{Name: "odd", Run: func(context.Context, []string) error { return nil }}}
	_, err := cli.Describe(context.Background(), "x", "", cmds)
	require.EqualError(t, err, "x odd: parsed 0 flag sets, want 1")
}
