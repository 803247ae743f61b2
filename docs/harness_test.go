package docs

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// fixture reads a page of testdata.
func fixture(t *testing.T, name string) page {
	t.Helper()
	p, err := parsePage(filepath.Join("testdata", name), "docs/testdata/"+name)
	require.NoError(t, err)
	return p
}

// The harness runs a runnable page's sh blocks in one shell, in a new
// working directory where the repository's files resolve, against the
// page's own database with the release binaries, stops its background
// blocks (SIGKILL for one that ignores SIGTERM) and what else it left
// running at the end, and runs no other block.
func TestHarnessRunsAPage(t *testing.T) {
	env := newRunEnv(t, stack.RepoRoot())
	env.stopGrace = time.Second
	env.timeout = 2 * time.Minute
	r, err := env.run(t, fixture(t, "runnable.md"))
	require.NoError(t, err)

	wd, err := os.ReadFile(filepath.Join(r.dir, "workdir"))
	require.NoError(t, err)
	require.Equal(t, r.dir, strings.TrimSpace(string(wd)))
	require.NotEqual(t, env.root, r.dir)

	// What the page wrote, read over a new connection: batcher migrate
	// ran, and the row names this run.
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, r.dbURL)
	require.NoError(t, err)
	defer conn.Close(ctx)
	var runID string
	require.NoError(t, conn.QueryRow(ctx, "SELECT run_id FROM docs_fixture WHERE id = 1").Scan(&runID))
	require.Equal(t, r.runID, runID)
	require.Regexp(t, `^docs-[0-9a-f]{12}$`, runID)
	var migrations int
	require.NoError(t, conn.QueryRow(ctx, "SELECT count(*) FROM outboxrelay_migrations").Scan(&migrations))
	require.Positive(t, migrations)

	// The background blocks and the page's own `sleep 300 &` end with it.
	for _, name := range []string{"background.pid", "stubborn.pid", "stray.pid"} {
		b, err := os.ReadFile(filepath.Join(r.dir, name))
		require.NoError(t, err)
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		require.NoError(t, err)
		require.Eventually(t, func() bool { return !running(pid) }, 10*time.Second, 50*time.Millisecond, "%s: pid %d still runs", name, pid)
	}
}

// Services started by `sh background` blocks run beside the page's
// commands (the documents arrive in the index) and are stopped when it
// ends.
func TestHarnessRunsServicesInTheBackground(t *testing.T) {
	env := newRunEnv(t, stack.RepoRoot())
	var before struct {
		count           int
		topics, indices []string
	}
	env.inspect = func(r *pageRun) {
		resp, err := http.Get(env.search + "/" + r.runID + "-products/_count")
		require.NoError(t, err)
		defer resp.Body.Close()
		var count struct {
			Count int `json:"count"`
		}
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&count))
		before.count = count.Count
		before.topics, before.indices, err = env.runLeftovers(context.Background(), r.runID)
		require.NoError(t, err)
	}
	r, err := env.run(t, fixture(t, "pipeline.md"))
	require.NoError(t, err)
	require.Equal(t, 50, before.count)

	// What the run made on the shared stack, and then deleted: its topic
	// (with the indexer's dead-letter topic) and its index.
	t.Logf("before cleanup: topics %v, indices %v", before.topics, before.indices)
	require.Contains(t, before.topics, r.runID+".products")
	require.Contains(t, before.indices, r.runID+"-products_v1")
	require.Eventually(t, func() bool {
		topics, indices, err := env.runLeftovers(context.Background(), r.runID)
		require.NoError(t, err)
		return len(topics) == 0 && len(indices) == 0
	}, 30*time.Second, 200*time.Millisecond, "topics or indices of run %s are left", r.runID)
	resp, err := http.Get(env.search + "/_cat/aliases/*" + r.runID + "*?format=json")
	require.NoError(t, err)
	defer resp.Body.Close()
	var aliases []any
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&aliases))
	require.Empty(t, aliases)

	for _, name := range []string{"publisher.pid", "indexer.pid"} {
		b, err := os.ReadFile(filepath.Join(r.dir, name))
		require.NoError(t, err)
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		require.NoError(t, err)
		require.Eventually(t, func() bool { return !running(pid) }, 10*time.Second, 50*time.Millisecond, "%s: pid %d still runs", name, pid)
	}
}

// A failing command fails the page, naming the page, the line and the
// command; nothing after it runs.
func TestHarnessNamesTheFailingLine(t *testing.T) {
	env := newRunEnv(t, stack.RepoRoot())
	_, err := env.run(t, fixture(t, "failing.md"))
	require.Error(t, err)
	msg := err.Error()
	require.True(t, strings.HasPrefix(msg, `docs/testdata/failing.md:11: test "$DOCS_RUN_ID" = "not-this-run": exit status 1`), msg)
	require.Contains(t, msg, "first block")
	require.NotContains(t, msg, "after the failure")
}

// A page past its time limit fails naming its block, and its processes
// are killed.
func TestHarnessTimeLimit(t *testing.T) {
	env := newRunEnv(t, stack.RepoRoot())
	env.timeout = 3 * time.Second
	r, err := env.run(t, fixture(t, "slow.md"))
	require.Error(t, err)
	require.True(t, strings.HasPrefix(err.Error(), "docs/testdata/slow.md:6: the block starting here: the page did not finish within 3s"), err.Error())
	b, err := os.ReadFile(filepath.Join(r.dir, "sleep.pid"))
	require.NoError(t, err)
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return !running(pid) }, 10*time.Second, 50*time.Millisecond, "the page's sleep (pid %d) still runs", pid)
}

// running: pid is a process that has not exited (a zombie has).
func running(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// pid (comm) state ...: comm may hold spaces and parentheses.
	s := string(b)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	return len(fields) > 0 && fields[0] != "Z"
}

// Only pages with the marker (outside code blocks) are run; in them,
// only `sh` and `sh background` blocks.
func TestHarnessSelectsPagesAndBlocks(t *testing.T) {
	t.Parallel()
	var ps []page
	for _, name := range []string{"runnable.md", "not-runnable.md", "failing.md"} {
		ps = append(ps, fixture(t, name))
	}
	var names []string
	for _, p := range runnable(ps) {
		names = append(names, p.path)
	}
	require.Equal(t, []string{"docs/testdata/runnable.md", "docs/testdata/failing.md"}, names)

	r := &pageRun{page: fixture(t, "runnable.md"), trace: "/dev/null"}
	require.NoError(t, r.build(filepath.Join(t.TempDir(), "page.sh")))
	script, err := os.ReadFile(r.script)
	require.NoError(t, err)
	require.NotContains(t, string(script), "exit 1", "a console or text block is in the script")
	require.Contains(t, string(script), "batcher migrate")

	bad := page{path: "x.md", blocks: []block{{info: "sh bg", line: 3, lines: []string{"true"}}}}
	r = &pageRun{page: bad, trace: "/dev/null"}
	require.EqualError(t, r.build(filepath.Join(t.TempDir(), "page.sh")),
		"x.md:2: code block info string \"sh bg\": a runnable page's blocks are `sh` (run), `sh background` (run in the background) or another language (shown only)")
}

// On a runnable page a bash, shell or zsh block is an error naming its
// line (it would be shown, not run), and so is a page with no sh block.
func TestHarnessRejectsShellBlocksItWouldNotRun(t *testing.T) {
	t.Parallel()
	for _, info := range []string{"bash", "shell", "zsh", "Bash title=x"} {
		p := page{path: "x.md", blocks: []block{
			{info: "sh", line: 3, lines: []string{"true"}},
			{info: info, line: 8, lines: []string{"batcher run"}},
		}}
		r := &pageRun{page: p, trace: "/dev/null"}
		require.EqualError(t, r.build(filepath.Join(t.TempDir(), "page.sh")),
			fmt.Sprintf("x.md:7: code block info string %q on a runnable page: it would be shown, not run; write `sh` (or `console` for a transcript that is not run)", info))
	}
	p := page{path: "x.md", blocks: []block{{info: "console", line: 3, lines: []string{"$ batcher run"}}}}
	r := &pageRun{page: p, trace: "/dev/null"}
	require.EqualError(t, r.build(filepath.Join(t.TempDir(), "page.sh")), "x.md: a runnable page without a `sh` block: nothing would run")
}

// TestRunnableDocs fails when no page is runnable, or when
// docs/getting-started.md is not: it cannot pass having run nothing.
func TestRunnableSetMustHoldGettingStarted(t *testing.T) {
	t.Parallel()
	require.EqualError(t, checkRunnableSet(nil), "no runnable page (none has the line <!-- runnable -->)")
	require.EqualError(t, checkRunnableSet([]page{fixture(t, "runnable.md")}),
		"docs/getting-started.md is not among the runnable pages (it must have the line <!-- runnable -->)")
	ps, err := pages(stack.RepoRoot())
	require.NoError(t, err)
	require.NoError(t, checkRunnableSet(runnable(ps)))
}

// A page sees the allowlisted variables of the test's environment, the
// stack's and its own, and nothing else: a TOPIC or OTEL_* set in CI does
// not change what its commands do.
func TestHarnessPageEnvironment(t *testing.T) {
	for k, v := range map[string]string{"TOPIC": "stray", "ALIAS": "stray", "KAFKA_TLS": "true", "LOG_LEVEL": "debug",
		"METRICS_ADDR": ":1", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://stray", "DATABASE_URL": "postgres://stray", "LANG": "C.UTF-8", "HOME": "/home/docs"} {
		t.Setenv(k, v)
	}
	e := &runEnv{bin: "/bin-dir", kafka: "k:9092", search: "http://s:9200"}
	got := map[string]string{}
	for _, kv := range e.environ(&pageRun{dbURL: "postgres://page", runID: "docs-1"}) {
		k, v, _ := strings.Cut(kv, "=")
		_, dup := got[k]
		require.False(t, dup, "%s twice", k)
		got[k] = v
	}
	want := map[string]string{
		"DATABASE_URL": "postgres://page", "KAFKA_BROKERS": "k:9092", "ELASTICSEARCH_URL": "http://s:9200", "DOCS_RUN_ID": "docs-1", "METRICS_ADDR": "",
		"PATH": "/bin-dir" + string(os.PathListSeparator) + os.Getenv("PATH"), "LANG": "C.UTF-8", "HOME": "/home/docs",
	}
	for _, k := range []string{"LC_ALL", "TMPDIR", "USER", "TERM"} {
		if v, ok := os.LookupEnv(k); ok {
			want[k] = v
		}
	}
	require.Equal(t, want, got)
}

// Every relative link of the pages names an existing file and, with an
// anchor, a heading of it.
func TestLinkCheckerNamesBrokenLinks(t *testing.T) {
	t.Parallel()
	root := filepath.Join("testdata", "links")
	ps, err := parsePages(root, []string{filepath.Join(root, "a.md"), filepath.Join(root, "b.md")})
	require.NoError(t, err)
	broken := checkLinks(root, ps)
	require.Len(t, broken, 3, strings.Join(broken, "\n"))
	require.Equal(t, "a.md:8: (missing.md): missing.md does not exist", broken[0])
	require.True(t, strings.HasPrefix(broken[1], "a.md:8: (b.md#nope): b.md has no heading with anchor #nope (it has: page-b, repeat, repeat-1, second-heading-v2, the-batcher-run-command)"), broken[1])
	require.True(t, strings.HasPrefix(broken[2], "a.md:8: (#not-here): a.md has no heading with anchor #not-here"), broken[2])
}
