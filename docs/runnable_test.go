package docs

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

func TestMain(m *testing.M) { stack.Main(m) }

// runnablePageTimeout bounds one page, every block and the background
// processes' shutdown included.
const runnablePageTimeout = 5 * time.Minute

// backgroundStopGrace is how long a background block has to end after the
// SIGTERM at the end of its page before it is killed.
const backgroundStopGrace = 20 * time.Second

// Every runnable page (see the package doc) runs, command by command,
// against the real stack with the binaries built from this tree.
func TestRunnableDocs(t *testing.T) {
	root := stack.RepoRoot()
	ps, err := pages(root)
	require.NoError(t, err)
	run := runnable(ps)
	t.Logf("%d of %d pages are runnable", len(run), len(ps))
	require.NoError(t, checkRunnableSet(run))
	env := newRunEnv(t, root)
	for _, p := range run {
		t.Run(p.path, func(t *testing.T) {
			if _, err := env.run(t, p); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// runnable are the pages with the marker.
func runnable(ps []page) []page {
	var out []page
	for _, p := range ps {
		if p.runnable {
			out = append(out, p)
		}
	}
	return out
}

// requiredRunnable are the pages that must stay runnable: their text
// promises that a test runs them. Losing the marker (or the parser losing
// it) would otherwise pass with nothing run.
var requiredRunnable = []string{"docs/getting-started.md"}

// checkRunnableSet fails when no page is runnable or one of
// requiredRunnable is not among them.
func checkRunnableSet(run []page) error {
	if len(run) == 0 {
		return fmt.Errorf("no runnable page (none has the line %s)", runnableMarker)
	}
	have := map[string]bool{}
	for _, p := range run {
		have[p.path] = true
	}
	for _, want := range requiredRunnable {
		if !have[want] {
			return fmt.Errorf("%s is not among the runnable pages (it must have the line %s)", want, runnableMarker)
		}
	}
	return nil
}

// runEnv is what every page's run shares: the repository and the release
// binaries.
type runEnv struct {
	root, bin string
	// The shared stack.
	kafka, search string
	timeout       time.Duration // per page
	stopGrace     time.Duration // for background blocks after SIGTERM
	// inspect, when set, sees each run after its processes are stopped
	// and before its topics and indices are deleted (for the tests of the
	// harness).
	inspect func(*pageRun)
}

func newRunEnv(t *testing.T, root string) *runEnv {
	// The stack first: under -short it skips the test before any build.
	kafka, search := strings.Join(stack.KafkaBrokers(t), ","), stack.ElasticsearchURL(t)
	bin, err := releaseBinaries(root)
	require.NoError(t, err)
	return &runEnv{root: root, bin: bin, kafka: kafka, search: search, timeout: runnablePageTimeout, stopGrace: backgroundStopGrace}
}

var release struct {
	once sync.Once
	dir  string
	err  error
}

// releaseBinaries builds the three binaries as the Dockerfile does (no
// build tags, no cgo, trimmed) once per test binary, into one directory
// (left in the temporary directory, as internal/testproc's builds are).
func releaseBinaries(root string) (string, error) {
	release.once.Do(func() {
		if release.dir, release.err = os.MkdirTemp("", "outboxrelay-docs-bin-"); release.err != nil {
			return
		}
		cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", release.dir+"/", "./cmd/batcher", "./cmd/publisher", "./cmd/indexer")
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			release.err = fmt.Errorf("go build: %w\n%s", err, b)
		}
	})
	return release.dir, release.err
}

// pageRun is one run of a page: its database, its run id, its script.
type pageRun struct {
	page   page
	dir    string // the working directory
	dbURL  string
	runID  string
	script string
	trace  string // the file the script reports progress to
	// stopGrace is how long background blocks get to end after SIGTERM.
	stopGrace time.Duration
	lineMap   map[int]int    // script line → page line
	blockAt   map[string]int // "block N" → the page line of its first line
}

// run runs page p's sh blocks; the error names the page and the line
// that failed, with the end of the output.
func (e *runEnv) run(t *testing.T, p page) (*pageRun, error) {
	r := &pageRun{page: p, dir: t.TempDir(), runID: "docs-" + randomHex(6), stopGrace: e.stopGrace}
	r.dbURL = newDatabase(t, strings.ReplaceAll(r.runID, "-", "_"))
	entries, err := os.ReadDir(e.root)
	if err != nil {
		return r, err
	}
	for _, en := range entries {
		if en.Name() == ".git" {
			continue
		}
		if err := os.Symlink(filepath.Join(e.root, en.Name()), filepath.Join(r.dir, en.Name())); err != nil {
			return r, err
		}
	}
	meta := t.TempDir()
	r.trace = filepath.Join(meta, "trace")
	if err := r.build(filepath.Join(meta, "page.sh")); err != nil {
		return r, err
	}
	out, err := os.Create(filepath.Join(meta, "output"))
	if err != nil {
		return r, err
	}
	defer out.Close()

	ctx, cancel := context.WithTimeout(context.Background(), e.timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", r.script)
	cmd.Dir = r.dir
	cmd.Stdin = nil
	cmd.Stdout, cmd.Stderr = out, out
	cmd.Env = e.environ(r)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 10 * time.Second
	runErr := cmd.Run()
	// What the page started and left running: its own `cmd &` (in the
	// script's process group) and the background blocks' groups.
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	r.killBackground()
	if e.inspect != nil {
		e.inspect(r)
	}
	// Its topics, indices and aliases, named after the run id, leave the
	// shared stack.
	cctx, ccancel := context.WithTimeout(context.Background(), time.Minute)
	defer ccancel()
	if err := e.cleanupRun(cctx, r.runID); err != nil {
		if runErr == nil {
			return r, fmt.Errorf("%s: cleaning up after the page: %w", p.path, err)
		}
		t.Logf("%s: cleaning up after the page: %v", p.path, err)
	}
	if runErr == nil {
		return r, nil
	}
	output, _ := os.ReadFile(out.Name())
	where := r.failure()
	if ctx.Err() != nil {
		return r, fmt.Errorf("%s: the page did not finish within %s\n--- output (last lines):\n%s", where, e.timeout, tailLines(string(output), 60))
	}
	return r, fmt.Errorf("%s: %v\n--- output (last lines):\n%s", where, runErr, tailLines(string(output), 60))
}

// pageEnvAllowlist are the variables of the test's environment a page
// inherits (when set): what a user's shell has. Everything else (a stray
// TOPIC, ALIAS, KAFKA_TLS, LOG_*, METRICS_*, OTEL_* of CI) would change
// what the page's commands do.
var pageEnvAllowlist = []string{"PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER", "TERM"}

// environ is the page's environment: the allowlisted variables of the
// test's, the stack's settings, the page's own database and run id, an
// empty METRICS_ADDR, and the binaries first on PATH.
func (e *runEnv) environ(r *pageRun) []string {
	var env []string
	for _, k := range pageEnvAllowlist {
		if v, ok := os.LookupEnv(k); ok && k != "PATH" {
			env = append(env, k+"="+v)
		}
	}
	return append(env,
		"DATABASE_URL="+r.dbURL,
		"KAFKA_BROKERS="+e.kafka,
		"ELASTICSEARCH_URL="+e.search,
		"DOCS_RUN_ID="+r.runID,
		// No metrics listener: the binaries' default ports (9101-9103)
		// would clash with the other pages and tests running at once (a
		// clean-clone CI run failed so: bind: address already in use).
		"METRICS_ADDR=",
		"PATH="+e.bin+string(os.PathListSeparator)+os.Getenv("PATH"),
	)
}

// build writes the page's script: its sh blocks in order, each announced
// in the trace file; a failing command writes its line there (ERR trap),
// background blocks their process group, and on exit they are stopped.
func (r *pageRun) build(path string) error {
	r.script, r.lineMap, r.blockAt = path, map[int]int{}, map[string]int{}
	var s []string
	add := func(line string, pageLine int) {
		s = append(s, line)
		if pageLine > 0 {
			r.lineMap[len(s)] = pageLine
		}
	}
	q := strconv.Quote(r.trace)
	add("set -Eeuo pipefail", 0)
	add("__docs_trace="+q, 0)
	add(`trap 'echo "err $LINENO" >> "$__docs_trace"' ERR`, 0)
	add("__docs_bg=()", 0)
	// On exit: SIGTERM to each background block's process group, up to
	// stopGrace for them to end (a service shuts down cleanly), then
	// SIGKILL.
	for _, l := range []string{
		`__docs_stop() {`,
		`  local s=$? p i`,
		`  trap - ERR`,
		`  for p in "${__docs_bg[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done`,
		fmt.Sprintf(`  for i in $(seq %d); do [ -z "$(jobs -rp)" ] && break; sleep 0.1; done`, int(r.stopGrace/(100*time.Millisecond))),
		`  for p in "${__docs_bg[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done`,
		`  for p in "${__docs_bg[@]}"; do wait "$p" 2>/dev/null || true; done`,
		`  exit "$s"`,
		`}`,
		`trap __docs_stop EXIT`,
	} {
		add(l, 0)
	}
	n := 0
	for _, b := range r.page.blocks {
		background := false
		switch {
		case b.info == "sh":
		case b.info == "sh background":
			background = true
		case b.info == "sh" || strings.HasPrefix(b.info, "sh "):
			return fmt.Errorf("%s:%d: code block info string %q: a runnable page's blocks are `sh` (run), `sh background` (run in the background) or another language (shown only)", r.page.path, b.line-1, b.info)
		case shellInfo(b.info):
			return fmt.Errorf("%s:%d: code block info string %q on a runnable page: it would be shown, not run; write `sh` (or `console` for a transcript that is not run)", r.page.path, b.line-1, b.info)
		default:
			continue
		}
		n++
		r.blockAt[fmt.Sprintf("block %d", n)] = b.line
		add(fmt.Sprintf(`echo "block %d" >> "$__docs_trace"`, n), 0)
		if background {
			add("set -m", 0)
			add("( trap - ERR", 0)
		}
		for i, l := range b.lines {
			add(l, b.line+i)
		}
		if background {
			add(`) & __docs_bg+=("$!"); echo "bg $!" >> "$__docs_trace"`, 0)
			add("set +m", 0)
		}
	}
	if n == 0 {
		return fmt.Errorf("%s: a runnable page without a `sh` block: nothing would run", r.page.path)
	}
	add("", 0)
	return os.WriteFile(path, []byte(strings.Join(s, "\n")), 0o600)
}

// shellInfo: the info string names a shell other than `sh` (bash, shell,
// zsh): on a runnable page such a block reads as a command to run but
// would not be.
func shellInfo(info string) bool {
	first, _, _ := strings.Cut(info, " ")
	switch strings.ToLower(first) {
	case "bash", "shell", "zsh":
		return true
	}
	return false
}

// failure names where the page failed: the page line of the last failing
// command the ERR trap saw, else the block that was running.
func (r *pageRun) failure() string {
	var lastErr, lastBlock string
	for _, l := range r.traceLines() {
		switch {
		case strings.HasPrefix(l, "err "):
			lastErr = strings.TrimPrefix(l, "err ")
		case strings.HasPrefix(l, "block "):
			lastBlock, lastErr = l, ""
		}
	}
	if n, err := strconv.Atoi(lastErr); err == nil {
		if pl, ok := r.lineMap[n]; ok {
			return fmt.Sprintf("%s:%d: %s", r.page.path, pl, strings.TrimSpace(r.page.lines[pl-1]))
		}
	}
	if pl, ok := r.blockAt[lastBlock]; ok {
		return fmt.Sprintf("%s:%d: the block starting here", r.page.path, pl)
	}
	return r.page.path
}

func (r *pageRun) traceLines() []string {
	f, err := os.Open(r.trace)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		out = append(out, sc.Text())
	}
	return out
}

// killBackground kills what is left of the background blocks' process
// groups (the script stops them on a normal exit; not when it was killed).
func (r *pageRun) killBackground() {
	for _, l := range r.traceLines() {
		if pid, err := strconv.Atoi(strings.TrimPrefix(l, "bg ")); err == nil && strings.HasPrefix(l, "bg ") {
			_ = syscall.Kill(-pid, syscall.SIGKILL)
		}
	}
}

// newDatabase creates an empty database on the shared server for the
// test and returns its URL; it is dropped when the test ends.
func newDatabase(t *testing.T, name string) string {
	base := stack.ServerURL(t)
	admin := func(sql string) error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		conn, err := pgx.Connect(ctx, base)
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		_, err = conn.Exec(ctx, sql)
		return err
	}
	ident := pgx.Identifier{name}.Sanitize()
	require.NoError(t, admin("CREATE DATABASE "+ident))
	t.Cleanup(func() {
		if err := admin("DROP DATABASE IF EXISTS " + ident + " WITH (FORCE)"); err != nil {
			t.Logf("drop database %s: %v", name, err)
		}
	})
	return stack.WithDatabase(base, name)
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
