package sink

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
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

// countingHandler counts the records whose message contains substr.
type countingHandler struct {
	substr string
	n      *atomic.Int64
}

func (h countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h countingHandler) Handle(_ context.Context, r slog.Record) error {
	if strings.Contains(r.Message, h.substr) {
		h.n.Add(1)
	}
	return nil
}
func (h countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h countingHandler) WithGroup(string) slog.Handler      { return h }

// A generation's end must not wait for its partition reader to close: the
// member has to rejoin within its session timeout, and a reader's Close
// waits for the requests it has in flight (23–32 s in CI under load).
// Here every Close takes 10 s, longer than the 6 s session: a second
// indexer joins, the first one's generation ends, and it must rejoin at
// once instead of being expelled ("Unknown Member ID") and taking the
// other's partitions away in turn.
func TestASlowReaderCloseDoesNotCostTheMembership(t *testing.T) {
	t.Parallel()
	es := stack.ElasticsearchURL(t)
	f := newFixture(t, es, es, 4)
	var failedJoins atomic.Int64
	cfg := f.cfg
	cfg.Logger = slog.New(countingHandler{substr: "joining the group failed", n: &failedJoins})
	slowClose := func(c *kgo.Client) {
		time.Sleep(10 * time.Second)
		c.Close()
	}
	join := func() {
		ix, err := New(cfg)
		require.NoError(t, err)
		ix.closeReader = slowClose
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- ix.Run(ctx) }()
		t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
	}
	produce := func(from, n int) {
		recs := make([]rec, n)
		for i := range recs {
			recs[i] = upsert(fmt.Sprintf("s-%04d", from+i), 1, docN(from+i))
		}
		f.produce(recs...)
	}
	produce(0, 200)
	join()
	f.waitCaughtUp(cfg.Group, time.Minute)
	join() // the first member's generation ends
	produce(200, 200)
	f.waitCaughtUp(cfg.Group, time.Minute)
	// Both members are in the stable group: no member was expelled on the
	// way.
	eventually(t, 30*time.Second, func() error {
		members, err := groupMembers(f, cfg.Group)
		if err == nil && members != 2 {
			err = fmt.Errorf("%d members in the stable group, want 2", members)
		}
		return err
	})
	require.Zero(t, failedJoins.Load(), "failed joins: a member was expelled while its reader closed")
	require.Len(t, f.search(cfg.Alias), 400)
}
