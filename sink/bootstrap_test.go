package sink

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// The first generation takes the aliases over from the empty index the
// indexer created at its start. An application event (no processor
// version) written through the write alias after the router counted that
// index empty but before the aliases moved landed in the bootstrap index,
// which nobody searches any more: it must end up in the live generation.
func TestFirstGenerationKeepsAnEventWrittenDuringTheTakeover(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg, direct, bootstrap := newBootstrap(t)

	// In front of the engine: just before the router's _aliases call, the
	// application's document is written through the write alias.
	var once sync.Once
	var injectErr error
	client := clientBehind(t, cfg.URL, func(w http.ResponseWriter, r *http.Request) bool {
		if r.Method == http.MethodPost && r.URL.Path == "/_aliases" {
			once.Do(func() {
				_, injectErr = direct.Index().Index(cfg.WriteAlias).Id("app-1").Version(4).VersionType("external").
					BodyString(`{"title":"written during the takeover"}`).Do(r.Context())
			})
		}
		return false
	})

	rt := newRouter(client, cfg, newRecordRules(cfg))
	require.NoError(t, rt.route(ctx, []*doc{{id: "g-1", alias: cfg.Alias, pv: "v7"}}))
	require.NoError(t, injectErr)
	live := index.GenerationIndex(cfg.Alias, "v7")
	targets, err := index.AliasTargets(ctx, direct, cfg.Alias)
	require.NoError(t, err)
	require.Equal(t, []string{live}, targets, "the first generation is live")
	_, err = direct.Refresh(cfg.Alias, bootstrap).Do(ctx)
	require.NoError(t, err)
	res, err := direct.Search(cfg.Alias).Query(elastic.NewIdsQuery().Ids("app-1")).Version(true).Do(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, res.TotalHits(), "the application's document is searchable after the takeover")
	require.EqualValues(t, 4, *res.Hits.Hits[0].Version, "with its external version")
}

// Two indexers start at once on a new alias. The other one creates the
// index, with both aliases in one call, right after this one looked its
// first alias up: this one must find the index created, not a read alias
// without a write alias (TestPipelineChaos: "indexer-1 exited: write alias
// missing").
func TestEnsureIndexLosesTheCreateRaceCleanly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	es := stack.ElasticsearchURL(t)
	direct, err := index.NewClient(es)
	require.NoError(t, err)
	cfg := Config{URL: es, Alias: stack.UniqueName("race")}.withDefaults()
	t.Cleanup(func() { _, _ = direct.DeleteIndex(cfg.Alias + "_*").Do(context.Background()) })

	// In front of the engine: the first alias lookup is answered, then the
	// other indexer's create goes through before this one's next request.
	target, err := url.Parse(es)
	require.NoError(t, err)
	proxy := httputil.NewSingleHostReverseProxy(target)
	var once sync.Once
	var other string
	var otherErr error
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		proxy.ServeHTTP(w, r)
		if r.Method == http.MethodGet && strings.HasPrefix(r.URL.Path, "/_alias/") {
			once.Do(func() { other, otherErr = index.Ensure(r.Context(), direct, cfg.Alias, cfg.WriteAlias, cfg.Mapping) })
		}
	}))
	t.Cleanup(srv.Close)
	client, err := index.NewClient(srv.URL)
	require.NoError(t, err)

	idx, err := index.Ensure(ctx, client, cfg.Alias, cfg.WriteAlias, cfg.Mapping)
	require.NoError(t, otherErr)
	require.NoError(t, err, "the loser of the race finds the index the winner created")
	require.Equal(t, other, idx)
	write, err := index.AliasTargets(ctx, direct, cfg.WriteAlias)
	require.NoError(t, err)
	require.Equal(t, []string{idx}, write)
}

// The first generation is created, then moving the aliases to it fails (a
// 429, a timeout; or the indexer is killed in between). The next batch
// finds the generation's write alias and must still take the aliases over:
// skipping it left the read alias on the empty bootstrap index, so
// searches found nothing until someone ran a cutover by hand.
func TestFirstGenerationTakesOverAfterAFailedMove(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg, direct, bootstrap := newBootstrap(t)

	// The first _aliases call is refused with 429.
	var once sync.Once
	client := clientBehind(t, cfg.URL, func(w http.ResponseWriter, r *http.Request) bool {
		refuse := false
		if r.Method == http.MethodPost && r.URL.Path == "/_aliases" {
			once.Do(func() { refuse = true })
		}
		if refuse {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusTooManyRequests)
			_, _ = w.Write([]byte(`{"error":{"type":"es_rejected_execution_exception","reason":"injected"},"status":429}`))
		}
		return refuse
	})

	live := index.GenerationIndex(cfg.Alias, "v7")
	rt := newRouter(client, cfg, newRecordRules(cfg))
	require.Error(t, rt.route(ctx, []*doc{{id: "g-1", alias: cfg.Alias, pv: "v7"}}))
	targets, err := index.AliasTargets(ctx, direct, cfg.Alias)
	require.NoError(t, err)
	require.Equal(t, []string{bootstrap}, targets, "the move was refused")

	// The batch again (or a restarted indexer: a new router).
	for _, rt := range []*router{rt, newRouter(client, cfg, newRecordRules(cfg))} {
		require.NoError(t, rt.route(ctx, []*doc{{id: "g-1", alias: cfg.Alias, pv: "v7"}}))
		targets, err = index.AliasTargets(ctx, direct, cfg.Alias)
		require.NoError(t, err)
		require.Equal(t, []string{live}, targets, "the first generation is live")
		writes, err := index.AliasTargets(ctx, direct, cfg.WriteAlias)
		require.NoError(t, err)
		require.Equal(t, []string{live}, writes)
	}
}

// newBootstrap is a new alias on the test engine as the indexer leaves it
// at its start: the read and write aliases on an empty bootstrap index
// (returned), which belongs to no processor version.
func newBootstrap(t *testing.T) (Config, *elastic.Client, string) {
	t.Helper()
	es := stack.ElasticsearchURL(t)
	direct, err := index.NewClient(es)
	require.NoError(t, err)
	cfg := Config{URL: es, Alias: stack.UniqueName("boot")}.withDefaults()
	t.Cleanup(func() { _, _ = direct.DeleteIndex(cfg.Alias + "_*").Do(context.Background()) })
	bootstrap, err := index.Ensure(context.Background(), direct, cfg.Alias, cfg.WriteAlias, cfg.Mapping)
	require.NoError(t, err)
	return cfg, direct, bootstrap
}

// clientBehind is a client of the engine at es through a proxy that first
// calls before for every request: true means before answered it, false
// that the request goes on to the engine.
func clientBehind(t *testing.T, es string, before func(http.ResponseWriter, *http.Request) bool) *elastic.Client {
	t.Helper()
	target, err := url.Parse(es)
	require.NoError(t, err)
	proxy := httputil.NewSingleHostReverseProxy(target)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !before(w, r) {
			proxy.ServeHTTP(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	client, err := index.NewClient(srv.URL)
	require.NoError(t, err)
	return client
}
