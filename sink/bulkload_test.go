package sink

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// The indexer builds a generation with refresh off and no replicas, and
// puts the mapping's settings back (with a refresh) once it has caught up
// with the topic, before it commits the offsets of that batch: so when the
// consumer group has caught up, everything is searchable through the alias
// and the generation refreshes every second again.
func TestGenerationIsBuiltInBulkLoadModeUntilCaughtUp(t *testing.T) {
	t.Parallel()
	es := stack.ElasticsearchURL(t)
	f := newFixture(t, es, es, 1)
	t.Cleanup(func() { _, _ = f.client.DeleteIndex(f.cfg.Alias + "_*").Do(context.Background()) })
	const n = 300
	var recs []rec
	for i := range n {
		r := upsert(fmt.Sprintf("b-%03d", i), 1, docN(i))
		r.headers = map[string]string{outbox.HeaderProcessorVersion: "v1"}
		recs = append(recs, r)
	}
	f.produce(recs...)

	ctx := context.Background()
	idx := index.GenerationIndex(f.cfg.Alias, "v1")
	var mu sync.Mutex
	var during []string // refresh interval of the generation after each bulk
	cfg := f.cfg
	cfg.BatchSize = 100
	cfg.BulkObserver = func(int, int, time.Duration) {
		s, err := index.BulkLoadSettings(ctx, f.client, idx)
		mu.Lock()
		defer mu.Unlock()
		during = append(during, s.RefreshInterval+" "+fmt.Sprint(err))
	}
	f.start(cfg)
	f.waitCaughtUp(cfg.Group, time.Minute)

	mu.Lock()
	require.NotEmpty(t, during)
	require.Equal(t, "-1 <nil>", during[0], "the first bulk of the %d documents went into a generation with refresh off", n)
	mu.Unlock()
	s, err := index.BulkLoadSettings(ctx, f.client, idx)
	require.NoError(t, err)
	require.Equal(t, index.BulkLoad{RefreshInterval: "1s", Replicas: "0"}, s, "the mapping's settings are back")
	gens, err := index.ListGenerations(ctx, f.client, idx)
	require.NoError(t, err)
	require.Len(t, gens, 1)
	require.Nil(t, gens[0].Meta.BulkLoad, "the mode is cleared from the generation's _meta")
	// No refresh of our own: the indexer's refresh made them searchable.
	c, err := f.client.Count(f.cfg.Alias).Do(ctx)
	require.NoError(t, err)
	require.EqualValues(t, n, c)
}

// A cutover to a generation still in bulk-load mode (the indexer has not
// caught up, or died before it ended the mode) puts its settings back and
// refreshes it before the aliases move: searches find every document at
// once, and later writes become searchable again.
func TestCutoverEndsTheBulkLoadFirst(t *testing.T) {
	t.Parallel()
	stack.EachEngine(t, testCutoverEndsTheBulkLoadFirst)
}

func testCutoverEndsTheBulkLoadFirst(t *testing.T, engineURL string) {
	t.Parallel()
	ctx := context.Background()
	es := engineURL
	client, err := index.NewClient(es)
	require.NoError(t, err)
	cfg := Config{URL: es, Alias: stack.UniqueName("bulkcut"),
		Mapping: []byte(`{"settings":{"index":{"number_of_shards":1,"refresh_interval":"2s","number_of_replicas":0}}}`)}.WithDefaults()
	t.Cleanup(func() { _, _ = client.DeleteIndex(cfg.Alias + "_*").Do(context.Background()) })
	live, err := index.CreateGeneration(ctx, client, cfg.Alias, "v1", cfg.Mapping, nil, false)
	require.NoError(t, err)
	_, err = index.MoveAliases(ctx, client, cfg.Alias, cfg.WriteAlias, live)
	require.NoError(t, err)
	next, err := index.CreateGeneration(ctx, client, cfg.Alias, "v2", cfg.Mapping, nil, true)
	require.NoError(t, err)
	s, err := index.BulkLoadSettings(ctx, client, next)
	require.NoError(t, err)
	require.Equal(t, index.BulkLoad{RefreshInterval: "-1", Replicas: "0"}, s)

	const n = 50
	bulk := client.Bulk().Index(index.GenerationWriteAlias(next))
	for i := range n {
		id := "c-" + strconv.Itoa(i)
		bulk.Add(elastic.NewBulkIndexRequest().Id(id).Version(1).VersionType("external").
			Doc(map[string]any{"n": i, FieldPV: "v2", FieldBucket: Bucket(id), FieldIDV: IDV(id, 1, false, "v2")}))
	}
	res, err := bulk.Do(ctx) // no refresh
	require.NoError(t, err)
	require.False(t, res.Errors)
	c, err := client.Count(next).Do(ctx)
	require.NoError(t, err)
	require.Zero(t, c, "refresh is off while the generation is built")

	from, err := index.MoveAliases(ctx, client, cfg.Alias, cfg.WriteAlias, next)
	require.NoError(t, err)
	require.Equal(t, []string{live}, from)
	c, err = client.Count(cfg.Alias).Do(ctx)
	require.NoError(t, err)
	require.EqualValues(t, n, c, "every document is searchable the moment the alias points at the generation")
	s, err = index.BulkLoadSettings(ctx, client, next)
	require.NoError(t, err)
	require.Equal(t, index.BulkLoad{RefreshInterval: "2s", Replicas: "0"}, s, "the mapping's settings are back")
	gens, err := index.ListGenerations(ctx, client, next)
	require.NoError(t, err)
	require.Nil(t, gens[0].Meta.BulkLoad)
	require.Equal(t, live, gens[0].Meta.Previous, "the rest of the cutover's record is kept")
}

// A batch counts as caught up when each of its partitions is within one
// batch of its end: under a steady stream a full batch often ends partway
// through one of its partitions.
func TestCaughtUpAllowsOneBatchOfSlack(t *testing.T) {
	t.Parallel()
	d := func(p int, off, hwm int64) *doc {
		return &doc{msg: kafka.Message{Partition: p, Offset: off, HighWaterMark: hwm}}
	}
	require.True(t, caughtUp([]*doc{d(0, 9, 10), d(1, 4, 5)}, 50), "both at the end")
	require.True(t, caughtUp([]*doc{d(0, 9, 10), d(1, 4, 54)}, 50), "49 behind")
	require.False(t, caughtUp([]*doc{d(0, 9, 10), d(1, 4, 55)}, 50), "50 behind")
	require.True(t, caughtUp([]*doc{d(0, 1, 500), d(0, 480, 500)}, 50), "the partition's last message counts")
	require.False(t, caughtUp(nil, 50), "an empty batch says nothing")
}
