package docs

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// Every relative link of every Markdown page of the repository (README.md,
// docs/, bench/, deploy/, …) points to a file that exists and, with
// #anchor, to a heading of it.
func TestDocsLinks(t *testing.T) {
	t.Parallel()
	root := stack.RepoRoot()
	ps, err := allPages(root)
	require.NoError(t, err)
	broken := checkLinks(root, ps)
	if len(broken) > 0 {
		t.Fatalf("%d broken link(s):\n%s", len(broken), strings.Join(broken, "\n"))
	}
}
