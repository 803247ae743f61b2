package sink

import (
	"context"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// A null value without a version (another producer's tombstone) takes the
// version the index holds when it is resolved. Replays are normal (a crash
// before the commit, a rebalance): replaying the tombstone after a later
// record of the key was indexed must not hide that later record — in a
// later batch or in the same one.
func TestNullValueDeleteReplayKeepsLaterRecord(t *testing.T) {
	t.Parallel()
	real := stack.ElasticsearchURL(t)
	f := newFixture(t, real, real, 1)
	ix, cfg := nullValueIndexer(t, f.cfg)
	ctx := context.Background()

	at := func(m kafka.Message, offset int64) kafka.Message {
		m.Topic, m.Partition, m.Offset = cfg.Topic, 0, offset
		return m
	}
	v5 := at(upsert("x", 5, docN(5)).message(), 10)
	null := at(kafka.Message{Key: []byte("x")}, 11) // no headers, no value
	v6 := at(upsert("x", 6, docN(6)).message(), 12)
	resolve := func(msgs ...kafka.Message) Batch {
		t.Helper()
		var batch []*doc
		for _, m := range msgs {
			d := ix.rules.parse(m)
			require.Nil(t, d.poison)
			batch = append(batch, d)
		}
		res, err := ix.resolve(ctx, batch)
		require.NoError(t, err)
		require.Zero(t, res.Dead)
		return res
	}
	live := func(what string) {
		t.Helper()
		x := f.get("x")
		require.True(t, x.Found, what)
		require.Equal(t, int64(6), x.Version, what)
		require.JSONEq(t, docN(6), string(x.Source), what)
	}

	// First run, one batch each.
	resolve(v5)
	resolve(null)
	x := f.get("x")
	require.Equal(t, int64(5), x.Version)
	require.JSONEq(t, `{"_deleted":true}`, string(x.Source), "the tombstone hides v5")
	resolve(v6)
	live("v6 after the tombstone")

	// Replay from the tombstone's offset, batch by batch.
	resolve(null)
	live("replayed tombstone (a later batch's v6 is indexed)")
	resolve(v6)
	live("replayed v6")

	// Replay with both in one batch.
	resolve(null, v6)
	live("replayed tombstone and v6 in one batch")

	// A replay that starts before v5 ends as the first run did.
	resolve(v5, null, v6)
	live("replay from v5")
}

// With NULL_VALUES=delete the indexer writes _pos into every document; an
// index whose mapping is strict (it declares _deleted, _bucket and _idv,
// the reserved fields docs/services.md lists) must take it, or every document would be
// dead-lettered.
func TestNullValueDeleteStrictMapping(t *testing.T) {
	t.Parallel()
	real := stack.ElasticsearchURL(t)
	f := newFixture(t, real, real, 1)
	cfg := f.cfg
	cfg.NullValues = NullValuesDelete
	cfg.Mapping = []byte(`{"settings":{"number_of_shards":1,"number_of_replicas":0,"refresh_interval":"1s"},"mappings":{"dynamic":"strict","properties":{"_deleted":{"type":"boolean"},"_bucket":{"type":"integer"},"_idv":{"type":"long"},"n":{"type":"integer"},"title":{"type":"keyword"}}}}`)
	f.produce(upsert("a", 1, docN(1)))
	f.start(cfg)
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	require.Equal(t, map[string]string{"a": "v1 " + docN(1)}, f.search(f.cfg.Alias))
}

// The engine may answer _mget 200 with an error for a document (a shard
// not available, the index briefly gone): the null value's version is not
// known then, and it is asked again. Taking the error for "not found" sent
// the tombstone at version 0, the engine answered 409, and the delete was
// counted as stale and committed: the document stayed searchable.
func TestNullValueDeleteRetriesAnMgetDocumentError(t *testing.T) {
	t.Parallel()
	real := stack.ElasticsearchURL(t)
	fi := newFaultInjector(t, real)
	f := newFixture(t, fi.URL(), real, 1)
	ix, cfg := nullValueIndexer(t, f.cfg)
	ctx := context.Background()

	at := func(m kafka.Message, offset int64) *doc { return parseAt(t, ix, m, cfg.Topic, offset) }
	res, err := ix.resolve(ctx, []*doc{at(upsert("x", 5, docN(5)).message(), 10)})
	require.NoError(t, err)
	require.Equal(t, 1, res.Indexed)

	fi.failNextMgetDocs(1)
	res, err = ix.resolve(ctx, []*doc{at(kafka.Message{Key: []byte("x")}, 11)})
	require.NoError(t, err)
	require.Equal(t, 2, fi.mgetCount(), "the failed lookup is asked again")
	require.Equal(t, Batch{Docs: 1, Indexed: 1, Attempts: 1}, res)
	x := f.get("x")
	require.Equal(t, int64(5), x.Version)
	require.JSONEq(t, `{"_deleted":true}`, string(x.Source), "the tombstone hides v5")

	// A lookup that keeps failing fails the batch: nothing is committed.
	fi.failNextMgetDocs(1000)
	cfg.RetryMaxElapsed = time.Second
	ix2, _ := nullValueIndexer(t, cfg)
	_, err = ix2.resolve(ctx, []*doc{parseAt(t, ix2, kafka.Message{Key: []byte("x")}, cfg.Topic, 12)})
	require.ErrorContains(t, err, "no_shard_available_action_exception")
}

// Positions are compared on one topic only: another topic feeding the same
// alias (a second indexer with its own TOPIC) numbers its partitions and
// offsets on its own. Its null value at a lower offset than the one the
// document was written from is no replay of an older record: it deletes.
func TestNullValueDeleteFromAnotherTopicIsNotOvertaken(t *testing.T) {
	t.Parallel()
	real := stack.ElasticsearchURL(t)
	f := newFixture(t, real, real, 1)
	ix, cfg := nullValueIndexer(t, f.cfg)
	ctx := context.Background()

	at := func(m kafka.Message, topic string, offset int64) *doc { return parseAt(t, ix, m, topic, offset) }
	res, err := ix.resolve(ctx, []*doc{at(upsert("x", 5, docN(5)).message(), cfg.Topic, 1000)})
	require.NoError(t, err)
	require.Equal(t, 1, res.Indexed)
	// The same topic, a lower offset: a replay, overtaken.
	res, err = ix.resolve(ctx, []*doc{at(kafka.Message{Key: []byte("x")}, cfg.Topic, 3)})
	require.NoError(t, err)
	require.Equal(t, 1, res.Conflicts)
	require.JSONEq(t, docN(5), string(f.get("x").Source))
	// Another topic, a lower offset: a delete.
	res, err = ix.resolve(ctx, []*doc{at(kafka.Message{Key: []byte("x")}, cfg.Topic+"-other", 3)})
	require.NoError(t, err)
	require.Equal(t, Batch{Docs: 1, Indexed: 1, Attempts: 1}, res)
	x := f.get("x")
	require.Equal(t, int64(5), x.Version)
	require.JSONEq(t, `{"_deleted":true}`, string(x.Source), "the tombstone hides v5")
}

// nullValueIndexer returns an indexer over cfg with NULL_VALUES=delete, its
// aliases and dead-letter topic created, not running: these tests resolve
// batches by hand. It also returns the config it was built with.
func nullValueIndexer(t *testing.T, cfg Config) (*Indexer, Config) {
	t.Helper()
	cfg.NullValues = NullValuesDelete
	ix, err := New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = ix.dlq.Close() })
	ctx := context.Background()
	_, err = index.Ensure(ctx, ix.client, ix.cfg.Alias, ix.cfg.WriteAlias, ix.cfg.Mapping)
	require.NoError(t, err)
	require.NoError(t, ensureTopic(ctx, ix.cfg.Brokers, ix.cfg.DeadLetterTopic, 1))
	return ix, cfg
}

// parseAt parses m as read from partition 0 of topic at offset; it must
// not be poison.
func parseAt(t *testing.T, ix *Indexer, m kafka.Message, topic string, offset int64) *doc {
	t.Helper()
	m.Topic, m.Partition, m.Offset = topic, 0, offset
	d := ix.rules.parse(m)
	require.Nil(t, d.poison)
	return d
}
