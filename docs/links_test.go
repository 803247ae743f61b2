package docs

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// Every relative link of README.md and docs/*.md points to a file that
// exists and, with #anchor, to a heading of it.
func TestDocsLinks(t *testing.T) {
	t.Parallel()
	root := stack.RepoRoot()
	ps, err := pages(root)
	require.NoError(t, err)
	broken := checkLinks(root, ps)
	require.Empty(t, broken, "broken links:\n%s", strings.Join(broken, "\n"))
}
