package stack

import (
	"cmp"
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
// creator's. When tb ends every thread of the three gets back the CPUs its
// process had before, and GOMAXPROCS its value.
//
// It needs two CPUs and a PostgreSQL and Kafka started by this checkout's
// scripts (STACK_DIR), whose processes it can find; it fails tb otherwise.
func PostgresApart(tb testing.TB) {
	tb.Helper()
	dir := cmp.Or(os.Getenv("STACK_DIR"), filepath.Join(RepoRoot(), ".stack"))
	postmaster := pidFile(filepath.Join(dir, "postgres", "data", "postmaster.pid"))
	kafka := pidFile(filepath.Join(dir, "kafka", "kafka.pid"))
	if postmaster <= 0 || kafka <= 0 {
		tb.Fatalf("PostgresApart: no PostgreSQL or Kafka of this checkout's stack in %s (postmaster pid %d, kafka pid %d); start it with scripts/stack/stack.sh up", dir, postmaster, kafka)
	}
	var all unix.CPUSet
	if err := unix.SchedGetaffinity(0, &all); err != nil {
		tb.Fatalf("PostgresApart: read this process's CPUs: %v", err)
	}
	var db, rest unix.CPUSet
	first := -1
	for c := range 1024 {
		if !all.IsSet(c) {
			continue
		}
		if first < 0 {
			first = c
			db.Set(c)
		} else {
			rest.Set(c)
		}
	}
	if rest.Count() == 0 {
		tb.Fatalf("PostgresApart: this process may use %d CPU; PostgreSQL apart needs 2", all.Count())
	}
	saved := map[int]unix.CPUSet{}
	for _, pid := range []int{postmaster, kafka} {
		var set unix.CPUSet
		if err := unix.SchedGetaffinity(pid, &set); err != nil {
			tb.Fatalf("PostgresApart: read the CPUs of pid %d: %v", pid, err)
		}
		saved[pid] = set
	}
	// pin sets the postmaster first, so a backend it forks while its
	// children are listed has the new CPUs already, and goes on after an
	// error, so that one process cannot keep the others where they were.
	pin := func(db, rest unix.CPUSet) error {
		errs := []error{setThreads(postmaster, db)}
		for _, pid := range children(postmaster) {
			errs = append(errs, setThreads(pid, db))
		}
		errs = append(errs, setThreads(kafka, rest), setThreads(os.Getpid(), rest))
		return errors.Join(errs...)
	}
	procs := runtime.GOMAXPROCS(rest.Count())
	tb.Cleanup(func() {
		runtime.GOMAXPROCS(procs)
		if err := pin(saved[postmaster], saved[kafka]); err != nil {
			tb.Errorf("PostgresApart: give the stack its CPUs back: %v", err)
		}
		if err := setThreads(os.Getpid(), all); err != nil {
			tb.Errorf("PostgresApart: give this process its CPUs back: %v", err)
		}
	})
	if err := pin(db, rest); err != nil {
		tb.Fatalf("PostgresApart: %v", err)
	}
	tb.Logf("PostgreSQL on CPU %d; Kafka and this process on the other %d (GOMAXPROCS %d)", first, rest.Count(), rest.Count())
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
		if err := unix.SchedSetaffinity(tid, &set); err != nil && err != unix.ESRCH {
			return fmt.Errorf("set the CPUs of thread %d of pid %d: %w", tid, pid, err)
		}
	}
	return nil
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
