package sink

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// Features says what an engine implementation under test can do, in the
// style of watermill's pubsub/tests.Features.
type Features struct {
	// InjectsFaults: the engine is a faultInjector in front of the real one.
	InjectsFaults bool
}

// engineUnderTest builds, per test, the URL the indexer writes to.
type engineUnderTest struct {
	name     string
	features Features
	// open returns the indexer-facing URL and, for the injector, the
	// injector itself.
	open func(t *testing.T, real string) (string, *faultInjector)
	// real is the engine behind it; nil means the stack's OpenSearch node.
	real func(testing.TB) string
}

var enginesUnderTest = []engineUnderTest{
	{name: "opensearch", open: func(t *testing.T, real string) (string, *faultInjector) { return real, nil }},
	{name: "elasticsearch-7.17", real: stack.Elasticsearch7URL, open: func(t *testing.T, real string) (string, *faultInjector) { return real, nil }},
	{name: "fault-injector", features: Features{InjectsFaults: true}, open: func(t *testing.T, real string) (string, *faultInjector) {
		fi := newFaultInjector(t, real)
		return fi.URL(), fi
	}},
}

// TestConformance runs the sink suite against the real engine and against
// the fault injector in front of it.
func TestConformance(t *testing.T) {
	t.Parallel()
	for _, e := range enginesUnderTest {
		t.Run(e.name, func(t *testing.T) {
			t.Parallel()
			runSuite(t, e)
		})
	}
}

func runSuite(t *testing.T, e engineUnderTest) {
	tests := []struct {
		name  string
		needs func(Features) bool
		run   func(t *testing.T, f *fixture, fi *faultInjector)
	}{
		{name: "ReplayTwiceIdentical", run: testReplayTwiceIdentical},
		{name: "OutOfOrderVersions", run: testOutOfOrderVersions},
		{name: "PartitionOrderAcrossLanes", run: testPartitionOrderAcrossLanes},
		{name: "DeleteSurvivesGCDeletes", run: testDeleteSurvivesGCDeletes},
		{name: "MappingErrorDeadLettered", run: testMappingErrorDeadLettered},
		{name: "PoisonDeadLettered", run: testPoisonDeadLettered},
		{name: "DeadLetterReplayAfterFix", run: testDeadLetterReplayAfterFix},
		{name: "InvalidIDAndReservedFieldsDeadLettered", run: testInvalidIDAndReservedFields},
		{name: "RequestLevel400Bisected", needs: func(f Features) bool { return f.InjectsFaults }, run: testRequestLevel400Bisected},
		{name: "OtherProducersRecords", run: testOtherProducersRecords},
		{name: "TypedIDs", run: testTypedIDs},
		{name: "PartialBulkFailureRetriedItemByItem", needs: func(f Features) bool { return f.InjectsFaults }, run: testPartialBulkFailure},
		{name: "WholeRequest429And503Retried", needs: func(f Features) bool { return f.InjectsFaults }, run: testWholeRequestFailures},
	}
	for _, tt := range tests {
		if tt.needs != nil && !tt.needs(e.features) {
			continue // not applicable to this implementation; run for the others
		}
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			realURL := stack.ElasticsearchURL
			if e.real != nil {
				realURL = e.real
			}
			real := realURL(t)
			u, fi := e.open(t, real)
			f := newFixture(t, u, real, 3)
			tt.run(t, f, fi)
		})
	}
}

func docN(n int) string { return fmt.Sprintf(`{"n":%d,"title":"doc %d"}`, n, n) }

// Replaying the whole topic twice (a new group each time, from the
// earliest offset) leaves the index identical and counts conflicts.
func testReplayTwiceIdentical(t *testing.T, f *fixture, _ *faultInjector) {
	var recs []rec
	for i := range 300 {
		id := fmt.Sprintf("id-%03d", i%100)
		v := int64(i/100 + 1)
		if i%100 == 7 && v == 3 {
			recs = append(recs, del(id, v))
			continue
		}
		recs = append(recs, upsert(id, v, docN(i)))
	}
	f.produce(recs...)
	var before map[string]string
	for pass := range 3 {
		cfg := f.cfg
		cfg.Group = stack.UniqueName("replay")
		ix := f.start(cfg)
		f.waitCaughtUp(cfg.Group, time.Minute)
		after := f.search(f.cfg.Alias)
		require.Len(t, after, 99, "pass %d: 100 ids, one deleted", pass)
		require.Equal(t, "v3 "+docN(200), after["id-000"])
		require.Equal(t, int64(3), f.get("id-007").Version)
		conflicts := counterValue(t, ix.m.docs.WithLabelValues("conflict"))
		if pass == 0 {
			before = after
			require.Zero(t, conflicts)
			require.Equal(t, 299.0, counterValue(t, ix.m.docs.WithLabelValues("indexed")))
			require.Equal(t, 1.0, counterValue(t, ix.m.docs.WithLabelValues("deleted")))
		} else {
			require.Equal(t, before, after, "pass %d changed the index", pass)
			require.Equal(t, 300.0, conflicts, "pass %d: every replayed message is a conflict", pass)
			require.Zero(t, counterValue(t, ix.m.docs.WithLabelValues("indexed")))
		}
		require.Zero(t, counterValue(t, ix.m.docs.WithLabelValues("dead_lettered")))
	}
}

// Versions 3, 5, 4, 5 of one key: the index ends at 5 with the version-5
// document, and the stale 4 and the duplicate 5 are conflicts.
func testOutOfOrderVersions(t *testing.T, f *fixture, _ *faultInjector) {
	f.produce(upsert("k", 3, docN(3)), upsert("k", 5, docN(5)), upsert("k", 4, docN(4)), upsert("k", 5, docN(55)))
	ix := f.start(f.cfg)
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	d := f.get("k")
	require.True(t, d.Found)
	require.Equal(t, int64(5), d.Version)
	require.JSONEq(t, docN(5), string(d.Source))
	require.Equal(t, 2.0, counterValue(t, ix.m.docs.WithLabelValues("conflict")))
}

// Every key gets versions 1 to 6 in order, in small batches over more
// lanes than partitions: a partition's batches must still reach the engine
// one after the other, so no version ever arrives after a newer one (which
// would be a version conflict).
func testPartitionOrderAcrossLanes(t *testing.T, f *fixture, _ *faultInjector) {
	cfg := f.cfg
	cfg.BatchSize = 3
	cfg.Lanes = 4
	var recs []rec
	for v := int64(1); v <= 6; v++ {
		for k := range 20 {
			recs = append(recs, upsert(fmt.Sprintf("k-%02d", k), v, docN(k*10+int(v))))
		}
	}
	f.produce(recs...)
	ix := f.start(cfg)
	f.waitCaughtUp(cfg.Group, time.Minute)
	require.Zero(t, counterValue(t, ix.m.docs.WithLabelValues("conflict")), "a version arrived after a newer one")
	require.Equal(t, 120.0, counterValue(t, ix.m.docs.WithLabelValues("indexed")))
	got := f.search(cfg.Alias)
	require.Len(t, got, 20)
	for k := range 20 {
		require.Equal(t, "v6 "+docN(k*10+6), got[fmt.Sprintf("k-%02d", k)])
	}
}

// A delete at version 7 stays effective against a replayed upsert at
// version 6 after the engine has forgotten its own delete tombstones
// (index.gc_deletes = 1s here). A plain external-versioned DELETE on a
// control document shows that the engine really forgot.
func testDeleteSurvivesGCDeletes(t *testing.T, f *fixture, _ *faultInjector) {
	f.produce(upsert("d", 5, docN(5)), del("d", 7))
	f.start(f.cfg)
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	require.NotContains(t, f.search(f.cfg.Alias), "d")

	index := f.writeIndex()
	plainDelete(t, f.client, index, "control", 5, 7)
	waitEngineForgotDelete(t, f.client, index, "control")

	f.produce(upsert("d", 6, docN(6)))
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	d := f.get("d")
	require.Equal(t, int64(7), d.Version)
	require.JSONEq(t, string(tombstoneDoc), string(d.Source))
	require.NotContains(t, f.search(f.cfg.Alias), "d")
}

func (f *fixture) writeIndex() string {
	f.t.Helper()
	targets, err := index.AliasTargets(context.Background(), f.client, f.cfg.withDefaults().WriteAlias)
	require.NoError(f.t, err)
	require.Len(f.t, targets, 1)
	return targets[0]
}

// plainDelete indexes id at version v and deletes it at version dv the way
// a naive sink would (external-versioned DELETE).
func plainDelete(t *testing.T, c *elastic.Client, index, id string, v, dv int64) {
	t.Helper()
	ctx := context.Background()
	_, err := c.Index().Index(index).Id(id).Version(v).VersionType("external").BodyString(`{"n":1}`).Do(ctx)
	require.NoError(t, err)
	_, err = c.Delete().Index(index).Id(id).Version(dv).VersionType("external").Do(ctx)
	require.NoError(t, err)
}

// waitEngineForgotDelete waits until an older upsert of a plainly deleted
// id is accepted again: the engine has dropped the delete tombstone. A 409
// changes nothing, so polling is side-effect free until it succeeds.
func waitEngineForgotDelete(t *testing.T, c *elastic.Client, index, id string) {
	t.Helper()
	ctx := context.Background()
	eventually(t, 30*time.Second, func() error {
		_, _ = c.Refresh(index).Do(ctx)
		// Any write lets the engine prune its version map.
		_, _ = c.Index().Index(index).Id("prune-trigger").BodyString(`{"n":0}`).Do(ctx)
		_, err := c.Index().Index(index).Id(id).Version(6).VersionType("external").BodyString(`{"n":6}`).Do(ctx)
		return err
	})
}

// A document the mapping refuses goes to the dead-letter topic with its
// original key, value and headers plus the error, and the partition moves
// on: the next message of the same key is indexed and offsets pass both.
func testMappingErrorDeadLettered(t *testing.T, f *fixture, _ *faultInjector) {
	bad := upsert("m", 1, `{"n":"not a number"}`)
	bad.headers = map[string]string{outbox.HeaderTraceParent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
	f.produce(upsert("a", 1, docN(1)), bad, upsert("m", 2, docN(2)))
	f.start(f.cfg)
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	require.Equal(t, int64(2), f.get("m").Version)
	dl := f.deadLetters(1)
	h := headerMap(dl[0])
	require.Equal(t, "m", string(dl[0].Key))
	require.Equal(t, `{"n":"not a number"}`, string(dl[0].Value))
	require.Equal(t, "mapper_parsing_exception", h[HeaderDLQCode])
	require.Equal(t, "400", h[HeaderDLQStatus])
	require.Contains(t, h[HeaderDLQReason], "[n]")
	require.Equal(t, f.cfg.Topic, h[HeaderDLQTopic])
	require.Equal(t, "1", h[outbox.HeaderAggregateVersion])
	require.Equal(t, bad.headers[outbox.HeaderTraceParent], h[outbox.HeaderTraceParent])

	st, err := GetStatus(context.Background(), f.cfg)
	require.NoError(t, err)
	require.Equal(t, int64(1), st.DeadLettered)
	require.Equal(t, int64(1), st.DeadLetterPending)
	require.Zero(t, st.TotalLag())
}

// A document refused by a strict mapping is dead-lettered; after the
// mapping is fixed, `dead-letter replay` re-publishes it and it is indexed.
func testDeadLetterReplayAfterFix(t *testing.T, f *fixture, _ *faultInjector) {
	f.produce(upsert("x", 4, `{"extra":{"color":"red"}}`), upsert("y", 1, docN(1)))
	f.start(f.cfg)
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	dl := f.deadLetters(1)
	require.Equal(t, "strict_dynamic_mapping_exception", headerMap(dl[0])[HeaderDLQCode])
	require.False(t, f.get("x").Found)

	// The fix: the mapping learns the field.
	_, err := f.client.PutMapping().Index(f.writeIndex()).BodyString(`{"properties":{"extra":{"type":"object","dynamic":"strict","properties":{"color":{"type":"keyword"}}}}}`).Do(context.Background())
	require.NoError(t, err)
	res, err := ReplayDeadLetters(context.Background(), f.cfg)
	require.NoError(t, err)
	require.Equal(t, 1, res.Republished)
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	d := f.get("x")
	require.Equal(t, int64(4), d.Version)
	st, err := GetStatus(context.Background(), f.cfg)
	require.NoError(t, err)
	require.Equal(t, int64(1), st.DeadLettered)
	require.Zero(t, st.DeadLetterPending)
	// Replaying again re-publishes nothing.
	res, err = ReplayDeadLetters(context.Background(), f.cfg)
	require.NoError(t, err)
	require.Zero(t, res.Republished)
}

// Messages that cannot be indexed at all never reach the engine.
func testPoisonDeadLettered(t *testing.T, f *fixture, _ *faultInjector) {
	noVersion := upsert("p", 1, docN(1)).message()
	noVersion.Headers = noVersion.Headers[:len(noVersion.Headers)-1]
	ctx := context.Background()
	require.NoError(t, f.writer.WriteMessages(ctx, noVersion))
	f.produce(rec{id: "q", version: 1, typ: "rename", doc: docN(1)}, upsert("r", 1, `[1,2]`), upsert("ok", 1, docN(1)))
	f.start(f.cfg)
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	codes := map[string]string{}
	for _, m := range f.deadLetters(3) {
		codes[string(m.Key)] = headerMap(m)[HeaderDLQCode]
	}
	require.Equal(t, map[string]string{"p": CodeBadVersion, "q": CodeUnknownType, "r": CodeInvalidJSON}, codes)
	require.Equal(t, map[string]string{"ok": "v1 " + docN(1)}, f.search(f.cfg.Alias))
}

// Items refused with 429 are sent again alone; the others are not resent.
func testPartialBulkFailure(t *testing.T, f *fixture, fi *faultInjector) {
	fi.failItem("b", 3, http.StatusTooManyRequests, "es_rejected_execution_exception")
	fi.failItem("c", 2, http.StatusServiceUnavailable, "unavailable_shards_exception")
	cfg := f.cfg
	cfg.FlushInterval, cfg.Linger = time.Second, true // one batch for all four
	cfg.Lanes = 1
	f.produce(upsert("a", 1, docN(1)), upsert("b", 1, docN(2)), upsert("c", 1, docN(3)), upsert("d", 1, docN(4)))
	ix := f.start(cfg)
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	require.Len(t, f.search(f.cfg.Alias), 4)
	var sent []string
	for _, ids := range fi.bulkIDs() {
		ids = slices.Clone(ids)
		slices.Sort(ids)
		sent = append(sent, strings.Join(ids, ","))
	}
	// b fails three times, c twice; a and d are never sent again.
	require.Equal(t, []string{"a,b,c,d", "b,c", "b,c", "b"}, sent)
	require.Equal(t, 3.0, counterValue(t, ix.m.retries.WithLabelValues("item_429")))
	require.Equal(t, 2.0, counterValue(t, ix.m.retries.WithLabelValues("item_5xx")))
	require.Greater(t, ix.throttle.limit(), 0.0, "429s lowered the budget")
}

func testWholeRequestFailures(t *testing.T, f *fixture, fi *faultInjector) {
	fi.failNextRequests(2, http.StatusTooManyRequests)
	f.produce(upsert("a", 1, docN(1)), upsert("b", 1, docN(2)))
	f.start(f.cfg)
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	fi.failNextRequests(1, http.StatusServiceUnavailable)
	f.produce(upsert("c", 1, docN(3)))
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	require.Len(t, f.search(f.cfg.Alias), 3)
}

// An _id over the engine's limit fails a whole bulk request on the engine;
// a key that is not UTF-8 cannot be an _id (JSON would make two such keys
// one document); a document field the indexer or the engine owns would
// hide the document (_deleted) or fail it. They are dead-lettered before
// the request, and the rest of the batch is indexed.
func testInvalidIDAndReservedFields(t *testing.T, f *fixture, _ *faultInjector) {
	long := strings.Repeat("k", MaxIDBytes+1)
	cfg := f.cfg
	cfg.FlushInterval, cfg.Linger = time.Second, true // one batch for all
	// Keys that are not UTF-8 (binary UUIDs, say): the engine's _id is a
	// string, and JSON would turn both into the same "\ufffd1".
	f.produce(upsert("a", 1, docN(1)), upsert(long, 1, docN(2)), upsert("hidden", 1, `{"n":3,"_deleted":true}`),
		upsert("meta", 1, `{"_id":"other","n":4}`), upsert("\xff1", 2, docN(6)), upsert("\xfe1", 1, docN(7)), upsert("b", 1, docN(5)))
	f.start(cfg)
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	codes := map[string]string{}
	for _, m := range f.deadLetters(5) {
		codes[string(m.Key)] = headerMap(m)[HeaderDLQCode]
	}
	require.Equal(t, map[string]string{long: CodeIDTooLong, "hidden": CodeReservedField, "meta": CodeReservedField,
		"\xff1": CodeInvalidKey, "\xfe1": CodeInvalidKey}, codes)
	require.Equal(t, map[string]string{"a": "v1 " + docN(1), "b": "v1 " + docN(5)}, f.search(f.cfg.Alias))
	require.False(t, f.get("hidden").Found)
}

// A bulk request the engine refuses as a whole (400) because of one item
// is split in halves until that item is alone; it is dead-lettered with
// the engine's error and every other document is indexed.
func testRequestLevel400Bisected(t *testing.T, f *fixture, fi *faultInjector) {
	fi.refuseRequestsHolding("bad", http.StatusBadRequest)
	cfg := f.cfg
	cfg.FlushInterval, cfg.Linger = time.Second, true // one batch for all eight
	cfg.Lanes = 1
	var recs []rec
	for i := range 8 {
		id := fmt.Sprintf("d%d", i)
		if i == 5 {
			id = "bad"
		}
		recs = append(recs, upsert(id, 1, docN(i)))
	}
	f.produce(recs...)
	f.start(cfg)
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	dl := f.deadLetters(1)
	require.Equal(t, "bad", string(dl[0].Key))
	h := headerMap(dl[0])
	require.Equal(t, "illegal_argument_exception", h[HeaderDLQCode])
	require.Equal(t, "400", h[HeaderDLQStatus])
	require.Len(t, f.search(f.cfg.Alias), 7)
	bulks := fi.bulkIDs()
	require.Contains(t, bulks, []string{"bad"}, "the bad item sent alone")
	require.LessOrEqual(t, len(bulks), 7, "bisection, not one request per item: %v", bulks)
}

func typed(r rec, aggregateType string) rec {
	r.headers = map[string]string{outbox.HeaderAggregateType: aggregateType}
	return r
}

// Records of other producers on the topic: application events of other
// types and aggregate types the deployment does not index are skipped
// (counted, committed, not dead-lettered); a null value is a delete
// (NULL_VALUES=delete) — at its version header's version, or without one
// at the version the index holds; records are routed to an alias by
// aggregate type.
func testOtherProducersRecords(t *testing.T, f *fixture, _ *faultInjector) {
	orders := f.cfg.Alias + "-orders"
	t.Cleanup(func() {
		_, _ = f.client.PerformRequest(context.Background(), elastic.PerformRequestOptions{Method: http.MethodDelete, Path: "/" + orders + "_v1", IgnoreErrors: []int{404}})
	})
	cfg := f.cfg
	cfg.SkipEventTypes = []string{"shop.order_shipped"}
	cfg.AggregateTypes = []string{"records", "orders"}
	cfg.NullValues = NullValuesDelete
	cfg.Routes = map[string]string{"orders": orders}
	shipped := rec{id: "s", version: 1, doc: docN(9), headers: map[string]string{outbox.HeaderType: "shop.order_shipped"}}
	f.produce(typed(upsert("x", 3, docN(1)), "records"), upsert("keep", 1, docN(2)), upsert("y", 1, docN(3)),
		typed(upsert("o1", 1, docN(4)), "orders"), typed(upsert("inv", 1, docN(5)), "invoices"), shipped)
	ctx := context.Background()
	require.NoError(t, f.writer.WriteMessages(ctx,
		kafka.Message{Key: []byte("x")}, // another producer's tombstone: no headers at all
		kafka.Message{Key: []byte("y"), Headers: []kafka.Header{{Key: outbox.HeaderAggregateVersion, Value: []byte("2")}}},
	))
	ix := f.start(cfg)
	f.waitCaughtUp(f.cfg.Group, time.Minute)

	require.Equal(t, map[string]string{"keep": "v1 " + docN(2)}, f.search(f.cfg.Alias))
	require.Equal(t, map[string]string{"o1": "v1 " + docN(4)}, f.search(orders))
	x := f.get("x")
	require.Equal(t, int64(3), x.Version, "the tombstone takes the version the index held")
	require.JSONEq(t, `{"_deleted":true}`, string(x.Source))
	require.Equal(t, int64(2), f.get("y").Version)
	st, err := GetStatus(ctx, f.cfg)
	require.NoError(t, err)
	require.Zero(t, st.DeadLettered, "nothing dead-lettered")
	require.Equal(t, 1.0, counterValue(t, ix.m.skipped.WithLabelValues(SkipEventType)))
	require.Equal(t, 1.0, counterValue(t, ix.m.skipped.WithLabelValues(SkipAggregateType)))

	// A late replay of the deleted version stays deleted; a newer one shows.
	f.produce(typed(upsert("x", 3, docN(1)), "records"), typed(upsert("y", 2, docN(6)), "records"))
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	require.Equal(t, map[string]string{"keep": "v1 " + docN(2)}, f.search(f.cfg.Alias))
	f.produce(typed(upsert("x", 4, docN(7)), "records"))
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	require.Equal(t, map[string]string{"keep": "v1 " + docN(2), "x": "v4 " + docN(7)}, f.search(f.cfg.Alias))
}

// ID_FORMAT=type:id keeps ids that collide across aggregate types apart.
func testTypedIDs(t *testing.T, f *fixture, _ *faultInjector) {
	cfg := f.cfg
	cfg.IDFormat = IDFormatTypeID
	f.produce(typed(upsert("1", 1, docN(1)), "orders"), typed(upsert("1", 2, docN(2)), "users"))
	f.start(cfg)
	f.waitCaughtUp(f.cfg.Group, time.Minute)
	require.Equal(t, map[string]string{"orders:1": "v1 " + docN(1), "users:1": "v2 " + docN(2)}, f.search(f.cfg.Alias))
}
