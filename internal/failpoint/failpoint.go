// Package failpoint lets crash tests kill a real process at a named point.
//
// Failpoints are compiled in always and cost one map lookup when unset. Set
// OUTBOXRELAY_FAILPOINT to a comma-separated list of names; the process kills
// itself with SIGKILL (no deferred functions, no rollback message, exactly
// like a power cut of the client) when it reaches one. "name@N" fires on the
// Nth time the point is reached (1-based), so a test can let some chunks
// commit before the crash.
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

func parse(s string) map[string]int {
	out := map[string]int{}
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
		out[name] = n
	}
	return out
}

// Hit kills the process if the failpoint name is armed and reached for the
// configured time.
func Hit(name string) {
	if len(armed) == 0 {
		return
	}
	mu.Lock()
	want, ok := armed[name]
	if ok {
		counts[name]++
		ok = counts[name] == want
	}
	mu.Unlock()
	if !ok {
		return
	}
	fmt.Fprintf(os.Stderr, "failpoint %s: killing process %d\n", name, os.Getpid())
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // SIGKILL is not deliverable late; never return.
}
