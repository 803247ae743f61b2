package sink

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// GroupReady fails before the indexer joined its group and after it left,
// saying so, and holds while it consumes.
func TestGroupReadyFollowsMembership(t *testing.T) {
	t.Parallel()
	es := stack.ElasticsearchURL(t)
	f := newFixture(t, es, es, 3)
	ix, err := New(f.cfg)
	require.NoError(t, err)
	ctx := context.Background()

	err = ix.GroupReady(ctx)
	require.ErrorContains(t, err, "not a member of group "+f.cfg.Group)

	// Another member of the group is not this indexer.
	other := f.start(f.cfg)
	eventually(t, time.Minute, func() error { return other.GroupReady(ctx) })
	require.ErrorContains(t, ix.GroupReady(ctx), "not a member of group")

	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ix.Run(runCtx) }()
	eventually(t, time.Minute, func() error { return ix.GroupReady(ctx) })
	require.NoError(t, ix.EngineReady(ctx))

	cancel()
	require.NoError(t, <-done)
	eventually(t, time.Minute, func() error {
		if err := ix.GroupReady(ctx); err == nil {
			return errNotYet
		}
		return nil
	})
	require.NoError(t, other.GroupReady(ctx))
}

var errNotYet = errors.New("still a member")

// EngineReady fails on a red cluster and on an engine that does not answer.
func TestEngineReadyFailsOnRed(t *testing.T) {
	t.Parallel()
	health := `{"cluster_name":"c1","status":"yellow","unassigned_shards":1}`
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(health))
	}))
	defer srv.Close()
	ix, err := New(Config{Brokers: []string{"127.0.0.1:1"}, URL: srv.URL})
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, ix.EngineReady(ctx), "yellow is ready")

	health = `{"cluster_name":"c1","status":"red","unassigned_shards":3}`
	require.EqualError(t, ix.EngineReady(ctx), "cluster c1 is red: 3 unassigned shards")

	srv.Close()
	require.ErrorContains(t, ix.EngineReady(ctx), "cluster health")
}
