package reconcile_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/reconcile"
)

// logBuffer collects log lines from several goroutines.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// count counts the lines that contain s.
func (b *logBuffer) count(s string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.Count(b.buf.String(), s)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// startAutoCutover runs reconcile.AutoCutover until the test ends.
func startAutoCutover(t *testing.T, f *rebuildFixture, logs *logBuffer) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- reconcile.AutoCutover(ctx, f.cfg, reconcile.AutoCutoverOptions{
			DB: f.pool, Jobs: []string{f.spec.Job}, Interval: 100 * time.Millisecond,
			Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		})
	}()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
}

// The rebuilt generation goes live without indexer cutover once it is
// ready: not after the rebuild run while rows changed behind it, but as soon
// as the catch-up run is indexed. After a rollback it stays where the
// operator put it.
func TestAutoCutoverMovesTheAliasOnceTheCatchUpRan(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newRebuildFixture(t, 300)
	f.run(t)
	f.index(t)
	require.EqualValues(t, 4, f.exec(t, `UPDATE source_records SET payload = payload || '{"title": "changed"}' WHERE id IN (SELECT id FROM source_records ORDER BY id LIMIT 4)`))

	var logs logBuffer
	startAutoCutover(t, f, &logs)
	require.Eventually(t, func() bool { return logs.count("waiting for the generation to be ready") > 0 }, time.Minute, 20*time.Millisecond)
	require.Contains(t, logs.String(), "4 row(s) of public.source_records changed after run")
	require.Equal(t, []string{f.live}, f.readAlias(t), "no cutover before the catch-up")

	f.run(t)
	f.index(t)
	require.Eventually(t, func() bool { return logs.count("the read alias moved to the rebuilt generation") == 1 }, time.Minute, 20*time.Millisecond, logs.String())
	for _, a := range []string{f.cfg.Alias, f.cfg.WriteAlias} {
		targets, err := index.AliasTargets(ctx, f.client, a)
		require.NoError(t, err)
		require.Equal(t, []string{f.next}, targets, "alias %s", a)
	}

	// The operator rolls back: the generation is not moved live again.
	_, into, err := index.Rollback(ctx, f.client, f.cfg.Alias, f.cfg.WriteAlias)
	require.NoError(t, err)
	require.Equal(t, f.live, into)
	require.Eventually(t, func() bool { return logs.count("rolled back from; left to the operator") > 0 }, time.Minute, 20*time.Millisecond, logs.String())
	require.Equal(t, []string{f.live}, f.readAlias(t))
	require.Equal(t, 1, logs.count("the read alias moved"))
	require.Zero(t, logs.count("level=WARN"), logs.String())
}

// Several indexers run the automatic cutover at once: one moves the
// aliases, the others find the generation live (or the alias locked), and
// none fails or moves anything else.
func TestAutoCutoverOfSeveralIndexersMovesOnce(t *testing.T) {
	t.Parallel()
	f := newRebuildFixture(t, 200)
	f.run(t)
	f.index(t)
	var logs logBuffer
	for range 3 {
		startAutoCutover(t, f, &logs)
	}
	require.Eventually(t, func() bool { return logs.count("the read alias moved to the rebuilt generation") > 0 }, time.Minute, 20*time.Millisecond, logs.String())
	require.Equal(t, []string{f.next}, f.readAlias(t))
	// A few more rounds of all three.
	require.Eventually(t, func() bool { return logs.count("nothing to do") >= 9 }, time.Minute, 20*time.Millisecond, logs.String())
	require.Equal(t, 1, logs.count("the read alias moved"), logs.String())
	require.Zero(t, logs.count("level=WARN"), logs.String())
}
