package sink

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// Zero-downtime reindex: searches through the read alias keep answering
// (and never see fewer documents) during the rebuild, live writes keep
// flowing, and after the swap the alias reads the new index with every
// document at its newest version and tombstones still hidden.
func TestReindexZeroDowntime(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testReindexZeroDowntime)
}

func testReindexZeroDowntime(t *testing.T, es string) {
	t.Parallel()
	f := newFixture(t, es, es, 3)
	var recs []rec
	for i := range 500 {
		recs = append(recs, upsert(fmt.Sprintf("r-%03d", i), 1, docN(i)))
	}
	recs = append(recs, del("r-000", 2))
	f.produce(recs...)
	f.start(f.cfg)
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	require.Len(t, f.search(f.cfg.Alias), 499)

	ctx, stop := context.WithCancel(context.Background())
	var searches, failures atomic.Int64
	var minSeen atomic.Int64
	minSeen.Store(1 << 40)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			n, err := countAlias(ctx, f.client, f.cfg.Alias)
			if ctx.Err() != nil {
				return
			}
			searches.Add(1)
			if err != nil {
				failures.Add(1)
				t.Logf("search during reindex: %v", err)
				continue
			}
			if n < minSeen.Load() {
				minSeen.Store(n)
			}
		}
	}()

	// Live traffic while the rebuild runs: new ids and updates.
	var live []rec
	for i := range 100 {
		live = append(live, upsert(fmt.Sprintf("r-%03d", i+1), 2, docN(i+1000)), upsert(fmt.Sprintf("n-%03d", i), 1, docN(i)))
	}
	f.produce(live...)
	cfg := f.cfg
	res, err := Reindex(context.Background(), cfg, ReindexOptions{Into: cfg.Alias + "_v2", Settle: 500 * time.Millisecond, Poll: 100 * time.Millisecond})
	require.NoError(t, err)
	require.Equal(t, cfg.Alias+"_v1", res.From)
	f.produce(upsert("after-swap", 1, docN(1)))
	f.waitCaughtUp(f.cfg.Group, time.Minute)

	reads, err := index.AliasTargets(context.Background(), f.client, cfg.Alias)
	require.NoError(t, err)
	require.Equal(t, []string{cfg.Alias + "_v2"}, reads)
	seen := f.search(cfg.Alias)
	stop()
	wg.Wait()
	require.Positive(t, searches.Load())
	require.Zero(t, failures.Load(), "searches failed during the rebuild")
	require.GreaterOrEqual(t, minSeen.Load(), int64(499), "a search saw documents missing")

	require.Len(t, seen, 499+100+1)
	require.NotContains(t, seen, "r-000")
	require.Equal(t, "v2 "+docN(1000), seen["r-001"])
	require.Equal(t, "v1 "+docN(499), seen["r-499"])
	require.Contains(t, seen, "after-swap")
	// The tombstone came along: an old upsert still cannot resurrect it.
	f.produce(upsert("r-000", 1, docN(0)))
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	require.NotContains(t, f.search(cfg.Alias), "r-000")

	// Running it again is a no-op.
	res, err = Reindex(context.Background(), cfg, ReindexOptions{Into: cfg.Alias + "_v2"})
	require.NoError(t, err)
	require.Equal(t, cfg.Alias+"_v2", res.From)
}

func countAlias(ctx context.Context, c *elastic.Client, alias string) (int64, error) {
	res, err := c.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method: http.MethodPost, Path: "/" + alias + "/_count",
		Body: map[string]any{"query": map[string]any{"match_all": map[string]any{}}},
	})
	if err != nil {
		return 0, err
	}
	var r struct {
		Count int64 `json:"count"`
	}
	return r.Count, json.Unmarshal(res.Body, &r)
}
