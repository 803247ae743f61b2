package sink

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	batchpkg "github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// Issue 27, item 8: the header ce_processorversion no longer creates an
// index for any value a producer puts there, nor writes into an index that
// is not the generation of the record's alias and version. With the jobs'
// registered versions (batch_processor_versions over DATABASE_URL):
// unknown versions are dead-lettered with a reason, create no index and no
// metric series; a version registered after the indexer started is found
// (read again on a miss); index.GenerationIndex("<a>", "eu_v1") and
// index.GenerationIndex("<a>_eu", "v1") name one index, which the _meta check
// refuses to share; an index <alias>_x without generation metadata is
// not adopted.
func TestProcessorVersionHeaderIsChecked(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testProcessorVersionHeaderIsChecked)
}

func testProcessorVersionHeaderIsChecked(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	_, err := batchpkg.SetLiveVersion(ctx, pool, "j", "v1", batchpkg.MovedByCutover)
	require.NoError(t, err)
	register := func(pv string) {
		_, err := pool.Exec(ctx, `INSERT INTO batch_processor_versions (job, processor_version) VALUES ('j', $1)`, pv)
		require.NoError(t, err)
	}
	f := newFixture(t, engineURL, engineURL, 1)
	alias := f.cfg.Alias
	t.Cleanup(func() { _, _ = f.client.DeleteIndex(alias + "_*").Do(context.Background()) })
	// Another alias's v1 generation, whose name is the one (alias, "eu_v1")
	// would get; and a foreign index named like a generation of alias.
	other := alias + "_eu"
	collide, err := index.CreateGeneration(ctx, f.client, other, "v1", f.cfg.Mapping, nil, false)
	require.NoError(t, err)
	require.Equal(t, index.GenerationIndex(alias, "eu_v1"), collide, "the two pairs name one index")
	foreign := alias + "_v3"
	require.NoError(t, index.Create(ctx, f.client, foreign, f.cfg.Mapping, nil))

	reg := prometheus.NewRegistry()
	cfg := f.cfg
	cfg.Registerer = reg
	cfg.RegisteredVersions = func(ctx context.Context) ([]string, error) { return batchpkg.RegisteredVersions(ctx, pool) }
	require.NoError(t, ensureTopic(ctx, cfg.Brokers, cfg.withDefaults().DeadLetterTopic, 1)) // deadLetters reads one partition
	f.start(cfg)
	at := func(id, pv string) rec {
		r := upsert(id, 1, `{"n": 1}`)
		r.headers = map[string]string{outbox.HeaderProcessorVersion: pv}
		return r
	}
	f.produce(at("1", "v1"), at("2", "evil"), at("3", "v2"))
	dead := f.deadLetters(2)
	for i, want := range []string{"evil", "v2"} {
		h := headerMap(dead[i])
		require.Equal(t, CodeUnknownProcessorVersion, h[HeaderDLQCode])
		require.Contains(t, h[HeaderDLQReason], fmt.Sprintf("ce_processorversion=%q: no job registered this processor version", want))
		require.Equal(t, want, h[outbox.HeaderProcessorVersion])
	}
	eventually(t, time.Minute, func() error {
		if got := f.search(alias); len(got) != 1 || got["1"] == "" {
			return fmt.Errorf("alias %s: %v", alias, got)
		}
		return nil
	})
	for _, pv := range []string{"evil", "v2"} {
		exists, err := f.client.IndexExists(index.GenerationIndex(alias, pv)).Do(ctx)
		require.NoError(t, err)
		require.False(t, exists, "no index for the unknown version %s", pv)
	}

	// v2 registered since (a rebuild started): its records are written.
	register("v2")
	f.produce(at("4", "v2"))
	eventually(t, time.Minute, func() error {
		n, err := index.CountDocs(ctx, f.client, index.GenerationIndex(alias, "v2"), nil)
		if err != nil || n != 1 {
			return fmt.Errorf("%s: %d documents (%v)", index.GenerationIndex(alias, "v2"), n, err)
		}
		return nil
	})

	// Registered, but their index is not theirs: dead-lettered, not written.
	register("eu_v1")
	register("v3")
	f.produce(at("5", "eu_v1"), at("6", "v3"))
	dead = f.deadLetters(4)
	h := headerMap(dead[2])
	require.Equal(t, CodeGenerationConflict, h[HeaderDLQCode])
	require.Contains(t, h[HeaderDLQReason], "is the generation of processor version \"v1\" of alias "+other)
	h = headerMap(dead[3])
	require.Equal(t, CodeGenerationConflict, h[HeaderDLQCode])
	require.Contains(t, h[HeaderDLQReason], "has no generation metadata")
	f.waitCaughtUp(cfg.Group, time.Minute)
	for _, idx := range []string{collide, foreign} {
		_, err := f.client.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodPost, Path: "/" + idx + "/_refresh"})
		require.NoError(t, err)
		n, err := index.CountDocs(ctx, f.client, idx, nil)
		require.NoError(t, err)
		require.Zero(t, n, "nothing written into %s", idx)
	}
	aliases, err := index.AliasTargets(ctx, f.client, index.GenerationWriteAlias(foreign))
	require.NoError(t, err)
	require.Empty(t, aliases, "no write alias added to %s", foreign)
	gens, err := index.ListGenerations(ctx, f.client, collide)
	require.NoError(t, err)
	require.Len(t, gens, 1)
	require.Equal(t, index.GenerationMeta{Alias: other, ProcessorVersion: "v1"}, index.GenerationMeta{Alias: gens[0].Meta.Alias, ProcessorVersion: gens[0].Meta.ProcessorVersion},
		"%s is still %s's generation", collide, other)

	fams, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range fams {
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				require.False(t, strings.Contains(lp.GetValue(), "evil"), "metric %s has a label of the unknown version: %s", mf.GetName(), lp)
			}
		}
	}
}

// PROCESSOR_VERSIONS without a database: only the listed versions get a
// generation; another is dead-lettered and creates no index.
func TestProcessorVersionsListed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	es := stack.ElasticsearchURL(t)
	f := newFixture(t, es, es, 1)
	alias := f.cfg.Alias
	t.Cleanup(func() { _, _ = f.client.DeleteIndex(alias + "_*").Do(context.Background()) })
	cfg := f.cfg
	cfg.ProcessorVersions = []string{"v1", "v2"}
	require.NoError(t, ensureTopic(ctx, cfg.Brokers, cfg.withDefaults().DeadLetterTopic, 1))
	f.start(cfg)
	at := func(id, pv string) rec {
		r := upsert(id, 1, `{"n": 1}`)
		r.headers = map[string]string{outbox.HeaderProcessorVersion: pv}
		return r
	}
	f.produce(at("1", "v2"), at("2", "v3"))
	dead := f.deadLetters(1)
	require.Equal(t, CodeUnknownProcessorVersion, headerMap(dead[0])[HeaderDLQCode])
	require.Equal(t, "2", string(dead[0].Key))
	f.waitCaughtUp(cfg.Group, time.Minute)
	require.NoError(t, index.Refresh(ctx, f.client, index.GenerationIndex(alias, "v2")))
	n, err := index.CountDocs(ctx, f.client, index.GenerationIndex(alias, "v2"), nil)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	exists, err := f.client.IndexExists(index.GenerationIndex(alias, "v3")).Do(ctx)
	require.NoError(t, err)
	require.False(t, exists, "no index for the unlisted version")
}
