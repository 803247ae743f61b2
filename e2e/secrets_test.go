package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// A real binary, DATABASE_URL with a password url.Parse misreads (an
// unescaped '#' or '?'): the error line masks it, given in a group-readable
// DATABASE_URL_FILE (a warning names the file) or as a flag (a warning
// points to DATABASE_URL / DATABASE_URL_FILE); no output shows the password.
func TestBinarySecretsNeverPrinted(t *testing.T) {
	t.Parallel()
	bin := testproc.Build(t, "publisher")
	file := filepath.Join(t.TempDir(), "database-url")
	require.NoError(t, os.WriteFile(file, []byte("postgres://app:#hunter2-file@127.0.0.1:1/app\n"), 0o600))
	require.NoError(t, os.Chmod(file, 0o640))

	p := testproc.Run(t, time.Minute, bin, []string{"DATABASE_URL=", "DATABASE_URL_FILE=" + file, "LOG_FORMAT=json"}, "migrate")
	require.Equal(t, 1, p.ExitCode(), p.Stderr())
	out := p.Stdout() + p.Stderr()
	require.NotContains(t, out, "hunter2")
	require.Contains(t, out, `DATABASE_URL_FILE=\"`+file+`\" is readable by its group (mode 0640)`)
	require.Contains(t, out, "publisher migrate: DATABASE_URL=postgres://app:xxxxx@127.0.0.1:1/app: cannot connect: ")

	p = testproc.Run(t, time.Minute, bin, []string{"DATABASE_URL=", "LOG_FORMAT=text"}, "migrate", "--database-url", "postgres://app:123?hunter2-flag@127.0.0.1:1/app")
	require.Equal(t, 1, p.ExitCode(), p.Stderr())
	out = p.Stdout() + p.Stderr()
	require.NotContains(t, out, "hunter2")
	require.Contains(t, out, "--database-url is given on the command line")
	require.Contains(t, out, "set DATABASE_URL or DATABASE_URL_FILE instead")
	lines := strings.Split(strings.TrimSpace(p.Stderr()), "\n")
	require.Equal(t, "publisher migrate: DATABASE_URL=postgres://app:xxxxx@127.0.0.1:1/app: cannot connect: ", lines[len(lines)-1][:len("publisher migrate: DATABASE_URL=postgres://app:xxxxx@127.0.0.1:1/app: cannot connect: ")])
}
