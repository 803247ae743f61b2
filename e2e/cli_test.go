package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// Every binary explains itself and migrates; a bad DATABASE_URL is one line
// that names the setting, with the password redacted, and a non-zero exit.
func TestBinariesHelpAndMigrate(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"batcher", "publisher", "indexer"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			bin := testproc.Build(t, name)

			help := testproc.Run(t, time.Minute, bin, nil, "--help")
			require.Equal(t, 0, help.ExitCode())
			require.Contains(t, help.Stdout(), "migrate")

			mh := testproc.Run(t, time.Minute, bin, nil, "migrate", "--help")
			require.Equal(t, 0, mh.ExitCode())
			require.Contains(t, mh.Stdout(), "DATABASE_URL")

			bad := testproc.Run(t, time.Minute, bin, []string{"DATABASE_URL=postgres://app:hunter2@127.0.0.1:1/app"}, "migrate")
			require.NotEqual(t, 0, bad.ExitCode())
			stderr := strings.TrimSpace(bad.Stderr())
			require.NotContains(t, stderr, "hunter2")
			require.Contains(t, stderr, "DATABASE_URL=postgres://app:xxxxx@127.0.0.1:1/app")
			require.Equal(t, 1, len(strings.Split(stderr, "\n")), "one line, got:\n%s", stderr)

			url := stack.Database(t) // already migrated: migrate is a no-op
			ok := testproc.Run(t, time.Minute, bin, []string{"DATABASE_URL=" + url, "LOG_FORMAT=json"}, "migrate")
			require.Equal(t, 0, ok.ExitCode(), ok.Stderr())
			require.Contains(t, ok.Stdout(), "0 migration(s) applied now")
		})
	}
}

// The hand-written pages of docs/ explain every setting of the services
// (docs/configuration.md, generated from the binaries, is left out: it
// lists every setting by construction).
func TestDocsExplainEverySetting(t *testing.T) {
	t.Parallel()
	pages, err := filepath.Glob(filepath.Join(stack.RepoRoot(), "docs", "*.md"))
	require.NoError(t, err)
	var docs strings.Builder
	for _, p := range pages {
		if filepath.Base(p) == "configuration.md" {
			continue
		}
		b, err := os.ReadFile(p)
		require.NoError(t, err)
		docs.Write(b)
	}
	for _, c := range [][]string{{"batcher", "run"}, {"publisher", "run"}, {"indexer", "run"}} {
		for _, env := range settingsOf(t, c[0], c) {
			require.Contains(t, docs.String(), "`"+env+"`", "no page of docs/ explains %s of `%s %s`", env, c[0], c[1])
		}
	}
}
