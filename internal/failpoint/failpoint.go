// Package failpoint lets crash tests kill a real process at a named point,
// or make PostgreSQL fail a statement there.
//
// Failpoints exist only in test builds. The product packages reach this
// package through a small file built with the failpoint build tag
// (batch/failpoint_on.go, sink/failpoint_on.go, manifest/failpoint_on.go);
// without the tag their hooks are empty functions and this package is not
// linked, so a release binary neither reads OUTBOXRELAY_FAILPOINT nor holds
// the word. Test binaries are built with the tag by internal/testproc.
//
// Set OUTBOXRELAY_FAILPOINT to a comma-separated list of names; the process
// kills itself with SIGKILL (no deferred functions, no rollback message,
// exactly like a power cut of the client) when it reaches one ([Hit]), or
// the point reports that it fires ([Fires]) and the caller makes the
// failure happen for real. "name@N" fires on the Nth time the point is
// reached (1-based), so a test can let some chunks commit before the
// crash; a name may be listed several times ("p@2,p@5").
package failpoint

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// EnvVar names the environment variable read at start.
const EnvVar = "OUTBOXRELAY_FAILPOINT"

var (
	mu     sync.Mutex
	armed  = parse(os.Getenv(EnvVar))
	counts = map[string]int{}
)

func parse(s string) map[string]map[int]bool {
	out := map[string]map[int]bool{}
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		name, nth, found := strings.Cut(part, "@")
		n := 1
		if found {
			if v, err := strconv.Atoi(nth); err == nil && v > 0 {
				n = v
			}
		}
		if out[name] == nil {
			out[name] = map[int]bool{}
		}
		out[name][n] = true
	}
	return out
}

// reached counts a visit of name and reports whether it fires.
func reached(name string) bool {
	if len(armed) == 0 {
		return false
	}
	mu.Lock()
	defer mu.Unlock()
	nths, ok := armed[name]
	if !ok {
		return false
	}
	counts[name]++
	return nths[counts[name]]
}

// Hit kills the process if the failpoint name is armed and reached for the
// configured time.
func Hit(name string) {
	if !reached(name) {
		return
	}
	fmt.Fprintf(os.Stderr, "failpoint %s: killing process %d\n", name, os.Getpid())
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // SIGKILL is not deliverable late; never return.
}

// Fires reports whether the failpoint name is armed and reached for the
// configured time, and logs it when it is. The caller then makes a real
// failure (e.g. a statement PostgreSQL rejects), so the code under test
// classifies an error it can meet in production, not a test's own.
func Fires(name string) bool {
	if !reached(name) {
		return false
	}
	fmt.Fprintf(os.Stderr, "failpoint %s: injecting an error\n", name)
	return true
}
