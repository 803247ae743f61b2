package sink

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

func TestComputeHorizonIsTheOldestSourceMinusTheMargin(t *testing.T) {
	now := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	at := func(minutesAgo int) time.Time { return now.Add(-time.Duration(minutesAgo) * time.Minute) }
	names := []string{"topic", "dead-letter topic", "outbox_events", "outbox_dead_letters"}
	for i, bounding := range names {
		t.Run(bounding, func(t *testing.T) {
			var sources []HorizonSource
			for j, name := range names {
				s := HorizonSource{Name: name, Oldest: at(10 + j)}
				if j == i {
					s.Oldest = at(100)
				}
				sources = append(sources, s)
			}
			h := ComputeHorizon(now, 5*time.Minute, sources)
			require.Equal(t, bounding, h.BoundedBy)
			require.Equal(t, at(105), h.At)
			var out bytes.Buffer
			h.Write(&out)
			require.Contains(t, out.String(), "bounded by "+bounding)
		})
	}
	t.Run("a source holding nothing does not bound it", func(t *testing.T) {
		h := ComputeHorizon(now, time.Minute, []HorizonSource{{Name: "topic"}, {Name: "outbox_events", Oldest: at(30)}})
		require.Equal(t, "outbox_events", h.BoundedBy)
		require.Equal(t, at(31), h.At)
	})
	t.Run("nothing held anywhere: now minus the margin", func(t *testing.T) {
		h := ComputeHorizon(now, time.Minute, []HorizonSource{{Name: "topic"}, {Name: "outbox_events"}})
		require.Equal(t, "", h.BoundedBy)
		require.Equal(t, at(1), h.At)
	})
}

// deleteRecords is Kafka's DeleteRecords request (API key 21), which
// kafka-go does not wrap: it moves a partition's log start offset, as
// retention does, at once.
type deleteRecordsRequest struct {
	Topics    []deleteRecordsTopic `kafka:"min=v0,max=v1"`
	TimeoutMs int32                `kafka:"min=v0,max=v1"`
}

type deleteRecordsTopic struct {
	Name       string                   `kafka:"min=v0,max=v1"`
	Partitions []deleteRecordsPartition `kafka:"min=v0,max=v1"`
}

type deleteRecordsPartition struct {
	PartitionIndex int32 `kafka:"min=v0,max=v1"`
	Offset         int64 `kafka:"min=v0,max=v1"`
}

func (*deleteRecordsRequest) ApiKey() protocol.ApiKey { return protocol.DeleteRecords }

type deleteRecordsResponse struct {
	ThrottleTimeMs int32                        `kafka:"min=v0,max=v1"`
	Topics         []deleteRecordsResponseTopic `kafka:"min=v0,max=v1"`
}

type deleteRecordsResponseTopic struct {
	Name       string                           `kafka:"min=v0,max=v1"`
	Partitions []deleteRecordsResponsePartition `kafka:"min=v0,max=v1"`
}

type deleteRecordsResponsePartition struct {
	PartitionIndex int32 `kafka:"min=v0,max=v1"`
	LowWatermark   int64 `kafka:"min=v0,max=v1"`
	ErrorCode      int16 `kafka:"min=v0,max=v1"`
}

func (*deleteRecordsResponse) ApiKey() protocol.ApiKey { return protocol.DeleteRecords }

func init() { protocol.Register(&deleteRecordsRequest{}, &deleteRecordsResponse{}) }

// deleteRecordsBefore drops partition of topic below offset (the broker
// is a single node, the leader of every partition).
func deleteRecordsBefore(t *testing.T, brokers []string, topic string, partition int, offset int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := kafka.DefaultTransport.RoundTrip(ctx, kafka.TCP(brokers...), &deleteRecordsRequest{
		Topics:    []deleteRecordsTopic{{Name: topic, Partitions: []deleteRecordsPartition{{PartitionIndex: int32(partition), Offset: offset}}}},
		TimeoutMs: 10_000,
	})
	require.NoError(t, err)
	r := res.(*deleteRecordsResponse)
	require.Len(t, r.Topics, 1)
	require.Len(t, r.Topics[0].Partitions, 1)
	p := r.Topics[0].Partitions[0]
	require.Zero(t, p.ErrorCode, "DeleteRecords error code")
	require.Equal(t, offset, p.LowWatermark)
}

// rawDoc reads id through the write alias: tombstones included, with
// FieldDeletedAt.
func rawDoc(t *testing.T, client *elastic.Client, writeAlias, id string) (found bool, version int64, src map[string]any) {
	t.Helper()
	found, version, src, err := rawDocErr(client, writeAlias, id)
	require.NoError(t, err)
	return found, version, src
}

func rawDocErr(client *elastic.Client, writeAlias, id string) (bool, int64, map[string]any, error) {
	res, err := client.PerformRequest(context.Background(), elastic.PerformRequestOptions{
		Method: http.MethodGet, Path: "/" + writeAlias + "/_doc/" + url.PathEscape(id), IgnoreErrors: []int{404},
	})
	if err != nil {
		return false, 0, nil, err
	}
	var d struct {
		Found   bool           `json:"found"`
		Version int64          `json:"_version"`
		Source  map[string]any `json:"_source"`
	}
	err = json.Unmarshal(res.Body, &d)
	return d.Found, d.Version, d.Source, err
}

// toPartition sends a message to the partition it names.
type toPartition struct{}

func (toPartition) Balance(m kafka.Message, _ ...int) int { return m.Partition }

// TestPurgeTombstonesThenReplayResurrectsNothing: tombstones older than the
// horizon are purged, those an older upsert still in the topic could undo
// are kept, and replaying the topic from the start into the same index
// brings nothing deleted back.
//
// b's upsert and delete are on different partitions (as after the topic
// grew partitions and the key moved), and retention has removed the
// delete but not the upsert: a replay then indexes b's upsert with no
// delete after it, and only b's tombstone stands in its way.
func TestPurgeTombstonesThenReplayResurrectsNothing(t *testing.T) {
	stack.EachEngine(t, func(t *testing.T, engineURL string) {
		f := newFixture(t, engineURL, engineURL, 2)
		ctx := context.Background()
		cfg := f.cfg.withDefaults()
		f.writer.Balancer = toPartition{}
		on := func(partition int, r rec) rec {
			r.partition = partition
			return r
		}
		f.start(cfg)

		tombstoneAt := func(id string, version int64) int64 {
			var at int64
			eventually(t, 60*time.Second, func() error {
				found, v, src, err := rawDocErr(f.client, cfg.WriteAlias, id)
				if err != nil {
					return err
				}
				if !found || v != version || src[FieldDeleted] != true {
					return fmt.Errorf("%s: found %v at version %d: %v", id, found, v, src)
				}
				at = int64(src[FieldDeletedAt].(float64))
				return nil
			})
			return at
		}
		// "a" is deleted, then the clock moves past its tombstone before
		// "b" and "c" are written: the horizon can fall between them.
		f.produce(on(0, upsert("a", 1, `{"n":1}`)), on(0, del("a", 2))) // partition 0, offsets 0, 1
		aDeletedAt := tombstoneAt("a", 2)
		eventually(t, 10*time.Second, func() error {
			if now := time.Now().UnixMilli(); now <= aDeletedAt {
				return fmt.Errorf("clock at %d, tombstone of a at %d", now, aDeletedAt)
			}
			return nil
		})
		f.produce(on(0, upsert("b", 1, `{"n":1}`)), on(0, upsert("c", 1, `{"n":3}`))) // partition 0, offsets 2, 3
		f.waitCaughtUp(cfg.Group, 60*time.Second)
		f.produce(on(1, del("b", 2))) // partition 1, offset 0
		tombstoneAt("b", 2)
		f.waitCaughtUp(cfg.Group, 60*time.Second)

		// Retention removes a's records and b's delete: b's upsert v1 is
		// the oldest record left, and it could undo b's tombstone.
		deleteRecordsBefore(t, cfg.Brokers, cfg.Topic, 0, 2)
		deleteRecordsBefore(t, cfg.Brokers, cfg.Topic, 1, 1)

		// The engine forgets a real delete's version after
		// index.gc_deletes; with 0 it does at the next refresh, so the
		// replay below meets exactly what the purge left.
		_, err := f.client.PerformRequest(ctx, elastic.PerformRequestOptions{
			Method: http.MethodPut, Path: "/" + cfg.WriteAlias + "/_settings",
			Body: map[string]any{"index": map[string]any{"gc_deletes": "0s"}},
		})
		require.NoError(t, err)

		// An unpublished outbox row of the topic, older than everything,
		// holds the horizon back: nothing is purged.
		pool := stack.Pool(t, stack.Database(t))
		_, err = pool.Exec(ctx, `INSERT INTO outbox_events (event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, created_at)
			VALUES (gen_random_uuid(), $1, 'thing', 'a', 1, 'upsert', '{}', now() - interval '1 hour')`, cfg.Topic)
		require.NoError(t, err)
		opts := PurgeOptions{DB: pool, Margin: 0}
		res, err := PurgeTombstones(ctx, cfg, opts)
		require.NoError(t, err)
		require.Equal(t, "outbox_events of topic "+cfg.Topic, res.Horizon.BoundedBy)
		require.Len(t, res.Indices, 1)
		require.Equal(t, int64(0), res.Indices[0].Purged)
		require.Equal(t, int64(2), res.Indices[0].Kept)
		found, _, _ := rawDoc(t, f.client, cfg.WriteAlias, "a")
		require.True(t, found, "a's tombstone kept while the outbox holds an older row")

		// Published: now the topic bounds the horizon, at b's upsert.
		_, err = pool.Exec(ctx, `DELETE FROM outbox_events WHERE topic = $1`, cfg.Topic)
		require.NoError(t, err)
		dry, err := PurgeTombstones(ctx, cfg, PurgeOptions{DB: pool, DryRun: true})
		require.NoError(t, err)
		require.Equal(t, "topic "+cfg.Topic, dry.Horizon.BoundedBy)
		require.Equal(t, int64(1), dry.Indices[0].Purged, "dry run counts a")
		found, _, _ = rawDoc(t, f.client, cfg.WriteAlias, "a")
		require.True(t, found, "a dry run deletes nothing")

		res, err = PurgeTombstones(ctx, cfg, opts)
		require.NoError(t, err)
		var out bytes.Buffer
		res.Write(&out, false)
		t.Log(out.String())
		require.Equal(t, "topic "+cfg.Topic, res.Horizon.BoundedBy)
		require.True(t, strings.Contains(res.Horizon.Sources[0].Detail, "partition 0 offset 2"), res.Horizon.Sources[0].Detail)
		require.Equal(t, int64(1), res.Indices[0].Purged)
		require.Equal(t, int64(1), res.Indices[0].Kept)
		found, _, _ = rawDoc(t, f.client, cfg.WriteAlias, "a")
		require.False(t, found, "a's tombstone purged: GET through the write alias finds nothing")
		found, v, src := rawDoc(t, f.client, cfg.WriteAlias, "b")
		require.True(t, found && v == 2 && src[FieldDeleted] == true, "b's tombstone is newer than the horizon and stays: %v v%d %v", found, v, src)

		// Replay the whole topic into the same index with a new group.
		_, err = f.client.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodPost, Path: "/" + cfg.WriteAlias + "/_refresh"})
		require.NoError(t, err)
		replay := cfg
		replay.Group = stack.UniqueName("replay")
		f.start(replay)
		f.waitCaughtUp(replay.Group, 60*time.Second)
		require.Equal(t, map[string]string{"c": `v1 {"n":3}`}, f.search(cfg.Alias), "nothing deleted comes back")
		found, _, _ = rawDoc(t, f.client, cfg.WriteAlias, "a")
		require.False(t, found)
		found, v, src = rawDoc(t, f.client, cfg.WriteAlias, "b")
		require.True(t, found && v == 2 && src[FieldDeleted] == true, "b still its tombstone: %v v%d %v", found, v, src)
	})
}

// An index created from a strict mapping that does not declare
// FieldDeletedAt (written before tombstones carried it) still takes
// tombstones: the indexer maps the field when it creates the index.
func TestTombstoneInStrictMappingCarriesDeletedAt(t *testing.T) {
	t.Parallel()
	real := stack.ElasticsearchURL(t)
	f := newFixture(t, real, real, 1)
	cfg := f.cfg.withDefaults()
	cfg.Mapping = []byte(`{"settings":{"number_of_shards":1,"number_of_replicas":0,"refresh_interval":"1s"},"mappings":{"dynamic":"strict","properties":{"_deleted":{"type":"boolean"},"_bucket":{"type":"integer"},"_idv":{"type":"long"},"n":{"type":"integer"}}}}`)
	before := time.Now().UnixMilli()
	f.produce(upsert("a", 1, docN(1)), del("a", 2))
	f.start(cfg)
	f.waitCaughtUp(cfg.Group, time.Minute)
	found, v, src := rawDoc(t, f.client, cfg.WriteAlias, "a")
	require.True(t, found && v == 2 && src[FieldDeleted] == true, "tombstone of a: %v v%d %v", found, v, src)
	at, ok := src[FieldDeletedAt].(float64)
	require.True(t, ok, "%s in %v", FieldDeletedAt, src)
	require.GreaterOrEqual(t, int64(at), before)
	require.LessOrEqual(t, int64(at), time.Now().UnixMilli())
}
