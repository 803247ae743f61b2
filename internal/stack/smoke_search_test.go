package stack_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// The search engine does what the indexer relies on: external versions
// guard writes, conflicts are 409s, and bulk reports per-item statuses.
func TestSmokeSearchExternalVersions(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	url := stack.ElasticsearchURL(t)
	client, err := elastic.NewClient(elastic.SetURL(url), elastic.SetSniff(false), elastic.SetHealthcheck(false))
	require.NoError(t, err)
	info, _, err := client.Ping(url).Do(ctx)
	require.NoError(t, err)
	t.Logf("search engine: %s (Lucene %s, %q) at %s", info.Version.Number, info.Version.LuceneVersion, info.TagLine, url)

	index := stack.UniqueName("smoke")
	_, err = client.CreateIndex(index).BodyString(`{"settings":{"number_of_shards":1,"number_of_replicas":0}}`).Do(ctx)
	require.NoError(t, err)

	put := func(id string, version int64, doc any) error {
		_, err := client.Index().Index(index).Id(id).Version(version).VersionType("external").BodyJson(doc).Do(ctx)
		return err
	}
	require.NoError(t, put("a", 5, map[string]any{"v": 5}))
	got, err := client.Get().Index(index).Id("a").Do(ctx)
	require.NoError(t, err)
	require.True(t, got.Found)
	require.EqualValues(t, 5, *got.Version)

	for _, stale := range []int64{5, 4} {
		err := put("a", stale, map[string]any{"v": stale})
		require.Error(t, err, "version %d must conflict", stale)
		require.True(t, elastic.IsConflict(err), "version %d: want 409, got %v", stale, err)
	}
	got, err = client.Get().Index(index).Id("a").Do(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 5, *got.Version)
	require.JSONEq(t, `{"v":5}`, string(got.Source))

	require.NoError(t, put("a", 6, map[string]any{"v": 6}))
	got, err = client.Get().Index(index).Id("a").Do(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 6, *got.Version)

	bulk := client.Bulk().Index(index).
		Add(elastic.NewBulkIndexRequest().Id("a").Version(6).VersionType("external").Doc(map[string]any{"v": 6})). // duplicate
		Add(elastic.NewBulkIndexRequest().Id("b").Version(1).VersionType("external").Doc(map[string]any{"v": 1})). // new
		Add(elastic.NewBulkIndexRequest().Id("a").Version(3).VersionType("external").Doc(map[string]any{"v": 3})). // stale
		Add(elastic.NewBulkIndexRequest().Id("a").Version(7).VersionType("external").Doc(map[string]any{"v": 7}))  // newer
	res, err := bulk.Do(ctx)
	require.NoError(t, err)
	require.True(t, res.Errors)
	var statuses []int
	for _, item := range res.Items {
		for _, r := range item {
			statuses = append(statuses, r.Status)
		}
	}
	require.Equal(t, []int{http.StatusConflict, http.StatusCreated, http.StatusConflict, http.StatusOK}, statuses)
	got, err = client.Get().Index(index).Id("a").Do(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 7, *got.Version)
}
