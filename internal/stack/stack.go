// Package stack gives tests the real servers outboxrelay runs against:
// PostgreSQL, a Kafka broker and an OpenSearch node, all started by the
// scripts in scripts/stack (no Docker).
//
// A running stack is reused when DATABASE_URL, KAFKA_BROKERS and
// ELASTICSEARCH_URL are set (`make test` starts one and exports them);
// otherwise the first test that needs a server starts it once for the whole
// test binary, and [Main] stops it when the binary exits. Tests that stop a
// server on purpose (outages, restarts) take a private one with [Private].
package stack

import (
	"bufio"
	"bytes"
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
)

// Main runs the tests of a package and stops every server this test binary
// started. Use it as: func TestMain(m *testing.M) { stack.Main(m) }.
func Main(m *testing.M) {
	closeInheritedOnExec()
	code := m.Run()
	stopAll()
	os.Exit(code)
}

// Server is one server started from a script with its own STACK_DIR.
type Server struct {
	Kind string   // the script: postgres, kafka, opensearch, elasticsearch, kafka-cluster, search-cluster, …
	Dir  string   // STACK_DIR
	Env  string   // the value printed by the script, e.g. 127.0.0.1:9092
	Vars []string // extra environment of the script ("K=V")
}

var (
	mu      sync.Mutex
	started []*Server
	shared  = map[string]*sharedServer{}
)

type sharedServer struct {
	once sync.Once
	env  string
	err  error
}

var envNames = map[string]string{
	"postgres":   "DATABASE_URL",
	"kafka":      "KAFKA_BROKERS",
	"opensearch": "ELASTICSEARCH_URL",
	// The second engine: Elasticsearch 7.17 (scripts/stack/elasticsearch.sh).
	"elasticsearch": "ELASTICSEARCH7_URL",
}

// RepoRoot returns the module root (the directory holding go.mod).
func RepoRoot() string {
	dir, err := os.Getwd()
	if err != nil {
		panic(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			panic("stack: go.mod not found above the working directory")
		}
		dir = parent
	}
}

func sharedEnv(tb testing.TB, kind string) string {
	tb.Helper()
	skipShort(tb, kind)
	if v := os.Getenv(envNames[kind]); v != "" {
		return v
	}
	mu.Lock()
	s, ok := shared[kind]
	if !ok {
		s = &sharedServer{}
		shared[kind] = s
	}
	mu.Unlock()
	s.once.Do(func() {
		dir, err := os.MkdirTemp("", "outboxrelay-stack-")
		if err != nil {
			s.err = err
			return
		}
		srv := &Server{Kind: kind, Dir: dir}
		s.err = srv.Start()
		s.env = srv.Env
	})
	if s.err != nil {
		tb.Fatalf("start %s: %v", kind, s.err)
	}
	return s.env
}

// Private starts a server of kind only this test uses, so the test may stop
// and restart it. It is purged when the test ends.
func Private(tb testing.TB, kind string) *Server {
	tb.Helper()
	skipShort(tb, kind)
	srv := &Server{Kind: kind, Dir: tb.TempDir()}
	if kind == "postgres" {
		// As root the script runs PostgreSQL as the postgres user, which
		// must reach the directory: the test's temp dir is 0700.
		_ = os.Chmod(filepath.Dir(srv.Dir), 0o755)
	}
	if err := srv.Start(); err != nil {
		tb.Fatalf("start private %s: %v", kind, err)
	}
	tb.Cleanup(func() { _ = srv.run("purge") })
	return srv
}

// Start starts the server (again, on the same port and data if it ran in
// this Dir before) and waits until it answers.
func (s *Server) Start() error {
	out, err := s.runOut("start")
	if err != nil {
		return err
	}
	line := lastLine(out)
	_, val, ok := strings.Cut(line, "=")
	if !ok {
		return fmt.Errorf("%s start printed %q, want NAME=value", s.Kind, line)
	}
	s.Env = val
	mu.Lock()
	registered := false
	for _, o := range started {
		registered = registered || o == s
	}
	if !registered {
		started = append(started, s)
	}
	mu.Unlock()
	return nil
}

// Stop stops the server and keeps its data.
func (s *Server) Stop() error { return s.run("stop") }

// Purge stops the server and removes its data.
func (s *Server) Purge() error { return s.run("purge") }

func (s *Server) run(verb string) error {
	_, err := s.runOut(verb)
	return err
}

func (s *Server) runOut(verb string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	script := filepath.Join(RepoRoot(), "scripts", "stack", s.Kind+".sh")
	cmd := exec.CommandContext(ctx, "bash", script, verb)
	cmd.Env = append(append(os.Environ(), s.Vars...), "STACK_DIR="+s.Dir)
	if os.Getenv("CACHE_DIR") == "" {
		cmd.Env = append(cmd.Env, "CACHE_DIR="+filepath.Join(RepoRoot(), ".cache"))
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("%s %s: %w\n%s", filepath.Base(script), verb, err, tail(stderr.String(), 40))
	}
	return stdout.String(), nil
}

func stopAll() {
	mu.Lock()
	defer mu.Unlock()
	for _, s := range started {
		_ = s.run("purge")
		_ = os.RemoveAll(s.Dir)
	}
	started = nil
}

// skipShort skips tests that need a server under `go test -short` (the
// `make test-short` target); `make test` and CI never pass -short.
func skipShort(tb testing.TB, kind string) {
	if testing.Short() {
		tb.Skipf("needs %s; run without -short", kind)
	}
}

func lastLine(s string) string {
	var last string
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		if l := strings.TrimSpace(sc.Text()); l != "" {
			last = l
		}
	}
	return last
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// KafkaBrokers returns the addresses of the shared Kafka broker.
func KafkaBrokers(tb testing.TB) []string {
	tb.Helper()
	return strings.Split(sharedEnv(tb, "kafka"), ",")
}

// ElasticsearchURL returns the URL of the shared search node.
func ElasticsearchURL(tb testing.TB) string {
	tb.Helper()
	return sharedEnv(tb, "opensearch")
}

// Elasticsearch7URL returns the URL of the shared Elasticsearch 7.17 node,
// the second engine the engine-facing suites run against.
func Elasticsearch7URL(tb testing.TB) string {
	tb.Helper()
	return sharedEnv(tb, "elasticsearch")
}

// UniqueName returns prefix plus a random suffix, for topics, indices and
// consumer groups that must not collide between tests.
func UniqueName(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + "-" + hex.EncodeToString(b[:])
}

// closeInheritedOnExec marks the descriptors this process inherited
// above stderr close-on-exec, so that the servers it starts do not hold
// them: `flock /tmp/bench.lock make bench-x` would otherwise stay locked
// for as long as a server the benchmark left behind runs. (Go opens its
// own descriptors close-on-exec; inherited ones stay open across exec.)
func closeInheritedOnExec() {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return // not Linux: nothing to do that matters here
	}
	for _, e := range entries {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd > 2 {
			syscall.CloseOnExec(fd)
		}
	}
}
