package stack_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// TestPostgresApartPinsAndGivesBack: while PostgresApart holds, a backend
// that was already running and one started after it run on one CPU, and
// this process on the others; when the test that asked for it ends, all of
// them have their CPUs back. SharedCPUs undoes what a killed run left.
func TestPostgresApartPinsAndGivesBack(t *testing.T) {
	ctx := context.Background()
	url := stack.Database(t)
	connect := func(t *testing.T) *pgx.Conn {
		conn, err := pgx.Connect(ctx, url)
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close(ctx) })
		return conn
	}
	backend := func(t *testing.T, conn *pgx.Conn) int {
		var pid int
		require.NoError(t, conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
		return pid
	}
	cpus := func(t *testing.T, conn *pgx.Conn) unix.CPUSet {
		var set unix.CPUSet
		require.NoError(t, unix.SchedGetaffinity(backend(t, conn), &set))
		return set
	}
	var self unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &self))
	require.GreaterOrEqual(t, self.Count(), 2, "this test needs 2 CPUs")
	stack.SharedCPUs(t)
	old := connect(t)
	before := cpus(t, old)
	require.Equal(t, self, before, "after SharedCPUs a backend may use this process's CPUs")

	t.Run("apart", func(t *testing.T) {
		stack.PostgresApart(t)
		running, started := cpus(t, old), cpus(t, connect(t))
		require.Equal(t, 1, running.Count(), "a running backend is on one CPU")
		require.Equal(t, running, started, "a new backend inherits the postmaster's CPU")
		var now unix.CPUSet
		require.NoError(t, unix.SchedGetaffinity(0, &now))
		require.Equal(t, self.Count()-1, now.Count(), "this process has the other CPUs")
		for c := range 1024 {
			require.False(t, running.IsSet(c) && now.IsSet(c), "CPU %d is both PostgreSQL's and this process's", c)
		}
	})

	require.Equal(t, before, cpus(t, old), "the running backend has its CPUs back")
	require.Equal(t, before, cpus(t, connect(t)), "a new backend has the postmaster's CPUs back")
	var after unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &after))
	require.Equal(t, self, after, "this process has its CPUs back")

	// What a run killed while PostgreSQL was apart leaves behind.
	var one unix.CPUSet
	one.Set(firstCPU(self))
	require.NoError(t, unix.SchedSetaffinity(backend(t, old), &one))
	require.Equal(t, one, cpus(t, old))
	stack.SharedCPUs(t)
	require.Equal(t, self, cpus(t, old), "SharedCPUs gives a pinned backend all CPUs")
}

func firstCPU(set unix.CPUSet) int {
	for c := range 1024 {
		if set.IsSet(c) {
			return c
		}
	}
	return -1
}
