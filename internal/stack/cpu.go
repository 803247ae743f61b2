package stack

import (
	"cmp"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// CPU is the processor time used so far by the local stack's servers and by
// this process. A benchmark reads it before and after a phase and logs the
// difference: on a shared 2-core machine it shows where a phase's time went,
// which a wall-clock figure alone cannot. A server that does not run from
// this checkout's scripts (STACK_DIR) counts as zero.
type CPU struct {
	Postgres, Kafka, Search, Self time.Duration
}

// ReadCPU reads the counters now.
func ReadCPU() CPU {
	dir := localStackDir()
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return CPU{
		// The postmaster's own time, its reaped children's (backends that
		// ended) and its live children's.
		Postgres: processTree(postmasterPID(dir)),
		Kafka:    processTime(kafkaPID(dir), false),
		Search:   processTime(pidFile(filepath.Join(dir, "opensearch", "opensearch.pid")), false),
		Self:     time.Duration(ru.Utime.Nano() + ru.Stime.Nano()),
	}
}

// Sub returns c - o.
func (c CPU) Sub(o CPU) CPU {
	return CPU{Postgres: c.Postgres - o.Postgres, Kafka: c.Kafka - o.Kafka, Search: c.Search - o.Search, Self: c.Self - o.Self}
}

func (c CPU) String() string {
	return fmt.Sprintf("CPU: postgres %.2fs, kafka %.2fs, search %.2fs, this process %.2fs",
		c.Postgres.Seconds(), c.Kafka.Seconds(), c.Search.Seconds(), c.Self.Seconds())
}

// clockTick is the kernel's unit for /proc/<pid>/stat times (USER_HZ).
const clockTick = 10 * time.Millisecond

// localStackDir is the STACK_DIR of the servers this checkout's scripts
// start (scripts/stack/stack.sh).
func localStackDir() string {
	return cmp.Or(os.Getenv("STACK_DIR"), filepath.Join(RepoRoot(), ".stack"))
}

// postmasterPID and kafkaPID are the pids of the servers under a STACK_DIR,
// 0 when they are not running from it.
func postmasterPID(dir string) int {
	return pidFile(filepath.Join(dir, "postgres", "data", "postmaster.pid"))
}

func kafkaPID(dir string) int { return pidFile(filepath.Join(dir, "kafka", "kafka.pid")) }

func pidFile(path string) int {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, _ := strconv.Atoi(strings.TrimSpace(line))
	return pid
}

// procStat returns the fields of /proc/<pid>/stat after the command name:
// [0] is the state, [1] the parent pid, [11..14] utime, stime, cutime, cstime.
func procStat(pid int) []string {
	if pid <= 0 {
		return nil
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+2 > len(s) {
		return nil
	}
	return strings.Fields(s[i+2:])
}

func processTime(pid int, children bool) time.Duration {
	f := procStat(pid)
	if len(f) < 15 {
		return 0
	}
	var ticks int64
	last := 12
	if children {
		last = 14
	}
	for i := 11; i <= last; i++ {
		n, _ := strconv.ParseInt(f[i], 10, 64)
		ticks += n
	}
	return time.Duration(ticks) * clockTick
}

func processTree(root int) time.Duration {
	if root <= 0 {
		return 0
	}
	total := processTime(root, true)
	for _, pid := range children(root) {
		total += processTime(pid, false)
	}
	return total
}

// CPU returns the processor time the server has used since it started (for
// PostgreSQL, the postmaster with its live and ended backends), so a
// benchmark on a private server can split its CPU-seconds per component
// without counting other users of the shared stack.
func (s *Server) CPU() time.Duration {
	switch s.Kind {
	case "postgres":
		return processTree(postmasterPID(s.Dir))
	case "kafka":
		return processTime(kafkaPID(s.Dir), false)
	default:
		return processTime(pidFile(filepath.Join(s.Dir, s.Kind, s.Kind+".pid")), false)
	}
}
