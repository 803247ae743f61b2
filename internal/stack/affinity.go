package stack

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// PostgresApart runs the local stack's PostgreSQL on one CPU of its own, and
// Kafka and this process on the others, until tb ends: the database on a
// host of its own, as it is deployed, on a machine that has no second host.
// On one shared machine a benchmark of a relay measures mostly the
// database's CPU (which a raw produce does not use) taken from the broker
// and the relay; apart, it measures what the relay adds on the producer's
// side. New backends inherit the postmaster's CPU and new threads their
// creator's. When tb ends every thread of the three may use all of this
// process's CPUs again (as after [SharedCPUs]), and GOMAXPROCS has its
// value back.
//
// It needs two CPUs and a PostgreSQL and Kafka started by this checkout's
// scripts (STACK_DIR), whose processes it can find; it fails tb otherwise.
func PostgresApart(tb testing.TB) {
	tb.Helper()
	p := findStack(tb)
	first := firstCPU(p.all)
	var db unix.CPUSet
	db.Set(first)
	rest := p.all
	rest.Clear(first)
	if rest.Count() == 0 {
		tb.Fatalf("PostgresApart: this process may use %d CPU; PostgreSQL apart needs 2", p.all.Count())
	}
	procs := runtime.GOMAXPROCS(rest.Count())
	tb.Cleanup(func() {
		runtime.GOMAXPROCS(procs)
		if err := p.pin(p.all, p.all); err != nil {
			tb.Errorf("PostgresApart: give the stack and this process their CPUs back: %v", err)
		}
	})
	if err := p.pin(db, rest); err != nil {
		tb.Fatalf("PostgresApart: %v", err)
	}
	tb.Logf("PostgreSQL on CPU %d; Kafka and this process on the other %d (GOMAXPROCS %d)", first, rest.Count(), rest.Count())
}

// SharedCPUs lets the local stack's PostgreSQL and Kafka, and this process,
// use all of this process's CPUs: the layout a benchmark that shares the
// machine means, whatever an earlier run that was killed before its
// cleanup (PostgresApart's) left behind.
func SharedCPUs(tb testing.TB) {
	tb.Helper()
	p := findStack(tb)
	if err := p.pin(p.all, p.all); err != nil {
		tb.Fatalf("SharedCPUs: %v", err)
	}
}

// stackProcs are the processes of this checkout's stack whose CPUs a
// benchmark sets, and the CPUs this process may use.
type stackProcs struct {
	postmaster, kafka int
	all               unix.CPUSet
}

func findStack(tb testing.TB) stackProcs {
	tb.Helper()
	dir := localStackDir()
	p := stackProcs{postmaster: postmasterPID(dir), kafka: kafkaPID(dir)}
	if p.postmaster <= 0 || p.kafka <= 0 {
		tb.Fatalf("no PostgreSQL or Kafka of this checkout's stack in %s (postmaster pid %d, kafka pid %d); start it with scripts/stack/stack.sh up", dir, p.postmaster, p.kafka)
	}
	if err := unix.SchedGetaffinity(0, &p.all); err != nil {
		tb.Fatalf("read this process's CPUs: %v", err)
	}
	return p
}

// pin gives PostgreSQL the CPUs in db and Kafka and this process those in
// rest. The postmaster goes first, so a backend it forks while its children
// are listed has the new CPUs already, and an error does not stop the rest,
// so that one process cannot keep the others where they were.
func (p stackProcs) pin(db, rest unix.CPUSet) error {
	errs := []error{setThreads(p.postmaster, db)}
	for _, pid := range children(p.postmaster) {
		errs = append(errs, setThreads(pid, db))
	}
	errs = append(errs, setThreads(p.kafka, rest), setThreads(os.Getpid(), rest))
	return errors.Join(errs...)
}

// setThreads gives every thread of pid the CPUs in set. A process or thread
// that ends meanwhile (a backend whose connection closed) is no error.
func setThreads(pid int, set unix.CPUSet) error {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("threads of pid %d: %w", pid, err)
	}
	for _, t := range tasks {
		tid, err := strconv.Atoi(t.Name())
		if err != nil {
			continue
		}
		if err := unix.SchedSetaffinity(tid, &set); err != nil && !errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("set the CPUs of thread %d of pid %d: %w", tid, pid, err)
		}
	}
	return nil
}

// firstCPU is the lowest CPU in set (-1 for none).
func firstCPU(set unix.CPUSet) int {
	for c := range len(set) * 64 {
		if set.IsSet(c) {
			return c
		}
	}
	return -1
}

// children lists the processes whose parent is pid.
func children(pid int) []int {
	var out []int
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		child, err := strconv.Atoi(filepath.Base(d))
		if err != nil {
			continue
		}
		if f := procStat(child); len(f) > 1 && f[1] == strconv.Itoa(pid) {
			out = append(out, child)
		}
	}
	return out
}
