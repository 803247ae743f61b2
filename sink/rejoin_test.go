package sink

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
)

// scriptedGroup answers Next with its errors, one per call, then waits for
// ctx; it counts the calls.
type scriptedGroup struct {
	mu    sync.Mutex
	errs  []error
	calls int
	asked chan struct{} // a call past the script
}

func (g *scriptedGroup) Next(ctx context.Context) (*kafka.Generation, error) {
	g.mu.Lock()
	g.calls++
	if len(g.errs) > 0 {
		err := g.errs[0]
		g.errs = g.errs[1:]
		g.mu.Unlock()
		return nil, err
	}
	g.mu.Unlock()
	close(g.asked)
	<-ctx.Done()
	return nil, ctx.Err()
}

// After a failed join or sync, kafka-go waits on its own before it tries
// again (JoinGroupBackoff), except after RebalanceInProgress, where it
// keeps its member id and must rejoin before the rebalance times out. It
// only tries again once Next is called: an indexer that waited its retry
// backoff before asking again was expelled from the group, rejoined as a
// new member, set off the next rebalance, and, with a backoff grown past
// the session timeout, two indexers kept each other out of the group for
// minutes (TestPipelineChaos in CI). So the indexer asks again at once.
func TestAFailedJoinIsRetriedAtOnce(t *testing.T) {
	t.Parallel()
	// A backoff far longer than the test: waiting it fails the test.
	ix := offlineIndexer(t, time.Hour, 2*time.Hour)
	g := &scriptedGroup{errs: []error{kafka.RebalanceInProgress, kafka.RebalanceInProgress, kafka.UnknownMemberId}, asked: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- ix.consume(ctx, g, newBacklog(ix.cfg)) }()
	select {
	case <-g.asked:
	case <-time.After(30 * time.Second):
		g.mu.Lock()
		defer g.mu.Unlock()
		t.Fatalf("the group was asked %d times in 30s after its failed joins; want 4 at once", g.calls)
	}
	cancel()
	require.NoError(t, <-done)
}

// A group that cannot be joined for longer than RetryMaxElapsed stops the
// indexer with the last error.
func TestJoinFailuresPastTheRetryBudgetStop(t *testing.T) {
	t.Parallel()
	ix := offlineIndexer(t, time.Millisecond, 200*time.Millisecond)
	g := &failingGroup{err: kafka.GroupAuthorizationFailed}
	start := time.Now()
	err := ix.consume(context.Background(), g, newBacklog(ix.cfg))
	require.ErrorIs(t, err, kafka.GroupAuthorizationFailed)
	require.True(t, strings.Contains(err.Error(), "join group g on t"), err.Error())
	require.GreaterOrEqual(t, time.Since(start), 200*time.Millisecond, "stopped before the retry budget was spent")
	require.Greater(t, g.calls, 2, "asked again after the first failures")
}

// offlineIndexer is an Indexer for topic t and group g whose retries wait
// backoff each and give up after budget; consume is all its tests call.
func offlineIndexer(t *testing.T, backoff, budget time.Duration) *Indexer {
	t.Helper()
	ix, err := New(Config{
		URL: "http://127.0.0.1:1", Brokers: []string{"127.0.0.1:1"}, Topic: "t", Group: "g",
		RetryInitial: backoff, RetryMax: backoff, RetryMaxElapsed: budget,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	require.NoError(t, err)
	return ix
}

// failingGroup fails every Next after a pause, as kafka-go does between
// failed joins.
type failingGroup struct {
	err   error
	calls int
}

func (g *failingGroup) Next(ctx context.Context) (*kafka.Generation, error) {
	g.calls++
	select {
	case <-time.After(10 * time.Millisecond):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return nil, g.err
}
