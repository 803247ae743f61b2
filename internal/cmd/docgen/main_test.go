package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/cli"
)

// The committed configuration reference is what the binaries' settings
// render to now: a changed flag, variable, default or help without `make
// docs` fails here, naming the first line that differs.
func TestConfigurationReferenceIsCurrent(t *testing.T) {
	root, err := repoRoot()
	require.NoError(t, err)
	bins, err := collect(context.Background(), root)
	require.NoError(t, err)
	spec, err := specFields(root)
	require.NoError(t, err)
	want := render(bins, spec)
	got, err := os.ReadFile(filepath.Join(root, page))
	require.NoError(t, err, "%s is missing: run %s", page, regenerate)
	if string(got) != want {
		t.Fatalf("%s differs from what the code declares (the binaries' settings, batch.Spec): run %s and commit it\n%s", page, regenerate, firstDifference(string(got), want))
	}
}

// firstDifference shows the first line where the committed page (got) and
// the generated one (want) differ.
func firstDifference(got, want string) string {
	g, w := strings.Split(got, "\n"), strings.Split(want, "\n")
	for i := 0; i < len(g) || i < len(w); i++ {
		var gl, wl string
		if i < len(g) {
			gl = g[i]
		}
		if i < len(w) {
			wl = w[i]
		}
		if gl != wl {
			return fmt.Sprintf("line %d:\n  committed: %s\n  generated: %s", i+1, gl, wl)
		}
	}
	return ""
}

// A command's table: every setting with its variable (— for a flag-only
// one), type and default; a secret names its file form; help text that
// Markdown would misread is escaped; an indented synopsis paragraph stays
// as --help prints it.
func TestRenderCommandTable(t *testing.T) {
	t.Parallel()
	page := render([]cli.Binary{{Name: "tool", About: "does things", Commands: []cli.DescribedCommand{{
		Name: "sync all", Summary: "sync everything", Synopsis: "Syncs every <thing>\nat once.\n\nFormat:\n  {\"a\": 1}",
		Settings: []cli.DescribedSetting{
			{Flag: "db-url", Env: "DB_URL", Kind: "string", Usage: "the database", Secret: true, FileFlag: "db-url-file"},
			{Flag: "db-url-file", Env: "DB_URL_FILE", Kind: "string", Usage: "file holding --db-url", SecretFile: true, FileOf: "db-url"},
			{Flag: "dry", Kind: "boolean", Default: "false", Usage: "a | b, *not* <both>, _id of A_B"},
		},
	}}}}, nil)
	for _, line := range []string{
		"- [tool](#tool): [sync all](#tool-sync-all)",
		"### tool sync all",
		"Sync everything.",
		"Syncs every &lt;thing&gt; at once.",
		"```text\nFormat:\n  {\"a\": 1}\n```",
		"| `--db-url` | `DB_URL` | string | *empty* | the database. *Secret*; or from a file: `DB_URL_FILE`. |",
		"| `--db-url-file` | `DB_URL_FILE` | string | *empty* | file holding --db-url. A file holding a secret: mode 0600 or 0400. |",
		"| `--dry` | — | boolean | `false` | a \\| b, \\*not\\* &lt;both&gt;, \\_id of A_B |",
		"| `DB_URL` | `--db-url` | **tool** every command |",
	} {
		require.Contains(t, page, line)
	}
}

func TestAnchorFollowsGitHub(t *testing.T) {
	t.Parallel()
	for heading, want := range map[string]string{
		"indexer dead-letter replay": "indexer-dead-letter-replay",
		"Environment variables":      "environment-variables",
		"What `--follow` does (v2)":  "what---follow-does-v2",
		"a_b c":                      "a_b-c",
	} {
		require.Equal(t, want, anchor(heading), heading)
	}
}
