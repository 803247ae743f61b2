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

// The README's configuration tables name every setting of the services.
func TestReadmeListsEverySetting(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile(filepath.Join(stack.RepoRoot(), "README.md"))
	require.NoError(t, err)
	for _, c := range [][]string{{"batcher", "run"}, {"publisher", "run"}, {"indexer", "run"}} {
		for _, env := range settingsOf(t, c[0], c) {
			require.Contains(t, string(readme), "`"+env+"`", "README.md does not document %s of `%s %s`", env, c[0], c[1])
		}
	}
}
