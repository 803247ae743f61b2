// Package testproc builds the project's binaries once per test binary and
// runs them as real processes, so crash tests can SIGKILL, SIGSTOP and
// SIGCONT them and check the database afterwards with a new connection.
package testproc

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

var (
	buildMu sync.Mutex
	built   = map[string]string{}
	binDir  string
)

// Build compiles ./cmd/<name> with the failpoint build tag (and -race when
// the test binary has it) once and returns the path of the binary.
func Build(tb testing.TB, name string) string {
	tb.Helper()
	buildMu.Lock()
	defer buildMu.Unlock()
	if p, ok := built[name]; ok {
		return p
	}
	if binDir == "" {
		d, err := os.MkdirTemp("", "outboxrelay-bin-")
		if err != nil {
			tb.Fatal(err)
		}
		binDir = d
	}
	out := filepath.Join(binDir, name)
	// The failpoint tag compiles in the hooks crash tests arm (internal/failpoint).
	args := []string{"build", "-tags", "failpoint", "-o", out}
	if raceEnabled {
		args = append(args, "-race")
	}
	args = append(args, "./cmd/"+name)
	cmd := exec.Command("go", args...)
	cmd.Dir = stack.RepoRoot()
	if b, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("go build %s: %v\n%s", name, err, b)
	}
	built[name] = out
	return out
}

// BuildRelease compiles ./cmd/<name> as the Dockerfile does (no build tags,
// no cgo, trimmed paths, no symbol table) into a new directory of the test
// and returns the path of the binary.
func BuildRelease(tb testing.TB, name string) string {
	tb.Helper()
	out := filepath.Join(tb.TempDir(), name)
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", out, "./cmd/"+name)
	cmd.Dir = stack.RepoRoot()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("go build %s: %v\n%s", name, err, b)
	}
	return out
}

// Proc is a running process with its captured output.
type Proc struct {
	Cmd    *exec.Cmd
	stdout bytes.Buffer
	stderr bytes.Buffer
	mu     sync.Mutex
	done   chan struct{}
	err    error
}

// Start runs binary with args and extra environment ("K=V"). The process is
// killed when the test ends if still running.
func Start(tb testing.TB, binary string, env []string, args ...string) *Proc {
	tb.Helper()
	p := &Proc{done: make(chan struct{})}
	p.Cmd = exec.Command(binary, args...)
	p.Cmd.Env = append(os.Environ(), env...)
	p.Cmd.Stdout = &lockedWriter{mu: &p.mu, buf: &p.stdout}
	p.Cmd.Stderr = &lockedWriter{mu: &p.mu, buf: &p.stderr}
	p.Cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := p.Cmd.Start(); err != nil {
		tb.Fatalf("start %s: %v", binary, err)
	}
	go func() {
		p.err = p.Cmd.Wait()
		close(p.done)
	}()
	tb.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.Cmd.Process.Signal(syscall.SIGCONT)
			_ = p.Cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

// Run starts the process and waits for it to exit (bounded by timeout).
func Run(tb testing.TB, timeout time.Duration, binary string, env []string, args ...string) *Proc {
	tb.Helper()
	p := Start(tb, binary, env, args...)
	if err := p.Wait(timeout); err != nil && !isExit(err) {
		tb.Fatalf("%s %v: %v\nstderr:\n%s", filepath.Base(binary), args, err, p.Stderr())
	}
	return p
}

func isExit(err error) bool {
	_, ok := err.(*exec.ExitError)
	return ok
}

// Wait waits for the process to exit; it returns the exec error (an
// *exec.ExitError for a non-zero exit or a signal) or a timeout error.
func (p *Proc) Wait(timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	select {
	case <-p.done:
		return p.err
	case <-ctx.Done():
		return fmt.Errorf("process %d still running after %s", p.Cmd.Process.Pid, timeout)
	}
}

// Done is closed when the process has exited.
func (p *Proc) Done() <-chan struct{} { return p.done }

// ExitCode is the exit code, -1 if killed by a signal or still running.
func (p *Proc) ExitCode() int {
	select {
	case <-p.done:
		return p.Cmd.ProcessState.ExitCode()
	default:
		return -1
	}
}

// Killed reports whether the process died of SIGKILL.
func (p *Proc) Killed() bool {
	select {
	case <-p.done:
	default:
		return false
	}
	ws, ok := p.Cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// Signal sends sig to the process.
func (p *Proc) Signal(sig syscall.Signal) error { return p.Cmd.Process.Signal(sig) }

// Stdout returns what the process printed so far.
func (p *Proc) Stdout() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stdout.String()
}

// Stderr returns what the process logged so far.
func (p *Proc) Stderr() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stderr.String()
}

type lockedWriter struct {
	mu  *sync.Mutex
	buf *bytes.Buffer
}

func (w *lockedWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.Write(b)
}

// Seed returns the seed of a randomized test: the value of the environment
// variable env when set (a replay), else a new one. It logs the seed at the
// start and again if the test fails, with the line that replays it.
func Seed(tb testing.TB, env string) uint64 {
	tb.Helper()
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv(env); v != "" {
		var err error
		if seed, err = strconv.ParseUint(v, 10, 64); err != nil {
			tb.Fatalf("%s=%q: %v", env, v, err)
		}
	}
	tb.Logf("seed %d (replay with %s=%d)", seed, env, seed)
	tb.Cleanup(func() {
		if tb.Failed() {
			tb.Logf("FAILED with seed %d: replay with %s=%d", seed, env, seed)
		}
	})
	return seed
}
