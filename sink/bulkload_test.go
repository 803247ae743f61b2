package sink

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// The indexer builds a generation with refresh off and no replicas. With
// BulkLoadMax 0 it puts the mapping's settings back (with a refresh) at
// the first batch that catches up with the topic, before it commits the
// offsets of that batch: so when the consumer group has caught up,
// everything is searchable through the alias and the generation refreshes
// every second again.
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
	cfg.BulkLoadMax = 0 // the zero value, said out loud: end at the first caught-up batch
	ends := recordBulkLoadEnds(&cfg)
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
	require.Equal(t, []string{bulkLoadEndedFirstCatchUp}, ends.reasons(idx), "the end is logged once, with its reason")
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

// A first fill that streams in faster than one batch a second keeps its
// generation in bulk-load mode although the indexer keeps up with it (each
// batch ends within one batch of its partition's end), and leaves the mode
// soon after the stream stops: then every document is searchable.
func TestBulkLoadLastsWhileTheLoadStreams(t *testing.T) {
	t.Parallel()
	es := stack.ElasticsearchURL(t)
	f := newFixture(t, es, es, 1)
	t.Cleanup(func() { _, _ = f.client.DeleteIndex(f.cfg.Alias + "_*").Do(context.Background()) })
	ctx := context.Background()
	idx := index.GenerationIndex(f.cfg.Alias, "v1")
	cfg := f.cfg
	cfg.BatchSize = 50
	cfg.BulkLoadMax = time.Minute // not reached in this test
	ends := recordBulkLoadEnds(&cfg)
	var sent atomic.Int64 // documents the indexer has sent to the engine
	cfg.BulkObserver = func(docs, _ int, _ time.Duration) { sent.Add(int64(docs)) }
	ix := f.start(cfg)
	eventually(t, 2*time.Minute, func() error { return ix.GroupReady(ctx) }) // not a stream into a joining group

	var streaming time.Time // when the indexer's first documents of the stream were sent
	checks := 0
	n, gap := f.stream(time.Minute, func() bool {
		if streaming.IsZero() {
			if sent.Load() > 0 {
				streaming = time.Now()
			}
			return false
		}
		if time.Since(streaming) < 1500*time.Millisecond {
			return false
		}
		// The stream is running: this check runs between two of its writes.
		s, err := index.BulkLoadSettings(ctx, f.client, idx)
		require.NoError(t, err)
		require.Equal(t, "-1", s.RefreshInterval, "refresh is still off %s into the stream (%d documents sent)",
			time.Since(streaming).Round(time.Millisecond), sent.Load())
		checks++
		return time.Since(streaming) > 3*time.Second
	})
	require.Positive(t, checks)
	stopped := time.Now()
	t.Logf("%d documents streamed, at most %s between two writes", n, gap.Round(time.Millisecond))

	// FinishBulkLoad clears the mode from the _meta last.
	eventually(t, 10*time.Second, func() error {
		gens, err := index.ListGenerations(ctx, f.client, idx)
		if err != nil {
			return err
		}
		if len(gens) != 1 || gens[0].Meta.BulkLoad != nil {
			return fmt.Errorf("still in bulk-load mode %s after the stream stopped", time.Since(stopped).Round(time.Millisecond))
		}
		return nil
	})
	t.Logf("bulk-load mode ended %s after the stream stopped", time.Since(stopped).Round(time.Millisecond))
	s, err := index.BulkLoadSettings(ctx, f.client, idx)
	require.NoError(t, err)
	require.Equal(t, index.BulkLoad{RefreshInterval: "1s", Replicas: "0"}, s, "the mapping's settings are back")
	// No refresh of our own: the indexer's refresh, or the restored refresh
	// interval for the last documents, makes them searchable.
	eventually(t, 10*time.Second, func() error {
		c, err := f.client.Count(f.cfg.Alias).Do(ctx)
		if err != nil || c != int64(n) {
			return fmt.Errorf("%d of %d documents searchable (%v)", c, n, err)
		}
		return nil
	})
	require.Equal(t, []string{bulkLoadEndedLoadStopped}, ends.reasons(idx), "the end is logged once, with its reason")
}

// A generation that receives a stream that does not stop leaves bulk-load
// mode after BulkLoadMax, while the stream still runs, and its documents
// become searchable.
func TestBulkLoadEndsAtBulkLoadMaxUnderASteadyStream(t *testing.T) {
	t.Parallel()
	es := stack.ElasticsearchURL(t)
	f := newFixture(t, es, es, 1)
	t.Cleanup(func() { _, _ = f.client.DeleteIndex(f.cfg.Alias + "_*").Do(context.Background()) })
	ctx := context.Background()
	idx := index.GenerationIndex(f.cfg.Alias, "v1")
	cfg := f.cfg
	cfg.BatchSize = 50
	cfg.BulkLoadMax = 2 * time.Second
	ends := recordBulkLoadEnds(&cfg)
	ix := f.start(cfg)
	eventually(t, 2*time.Minute, func() error { return ix.GroupReady(ctx) })

	// The stream stops only once the generation has been in the mode and
	// left it: it is running when the mode ends.
	inMode := false
	n, gap := f.stream(time.Minute, func() bool {
		gens, err := index.ListGenerations(ctx, f.client, idx)
		if err != nil || len(gens) != 1 {
			return false // not created yet
		}
		if gens[0].Meta.BulkLoad != nil {
			inMode = true
			return false
		}
		return inMode
	})
	s, err := index.BulkLoadSettings(ctx, f.client, idx)
	require.NoError(t, err)
	require.Equal(t, index.BulkLoad{RefreshInterval: "1s", Replicas: "0"}, s, "the mapping's settings are back")
	eventually(t, 10*time.Second, func() error {
		c, err := f.client.Count(f.cfg.Alias).Do(ctx)
		if err != nil || c != int64(n) {
			return fmt.Errorf("%d of %d documents searchable (%v)", c, n, err)
		}
		return nil
	})
	require.Equal(t, []string{bulkLoadEndedMax}, ends.reasons(idx), "the end is logged once, with its reason (at most %s between two writes)", gap.Round(time.Millisecond))
}

// stream writes 10 documents of processor version v1 every 20 ms (500 a
// second, ten times the tests' BatchSize, in batches the indexer keeps up
// with) until done returns true, which it asks between two writes. It
// fails the test after timeout, and returns how many it wrote and the
// longest time between two writes' ends: a broker that stalls the stream
// for a second stops the load as far as the indexer can tell.
func (f *fixture) stream(timeout time.Duration, done func() bool) (n int, longestGap time.Duration) {
	f.t.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	var last time.Time
	for !done() {
		if time.Now().After(deadline) {
			f.t.Fatalf("still streaming after %s (%d documents)", timeout, n)
		}
		recs := make([]rec, 10)
		for i := range recs {
			recs[i] = upsert(fmt.Sprintf("s-%06d", n), 1, docN(n))
			recs[i].headers = map[string]string{outbox.HeaderProcessorVersion: "v1"}
			n++
		}
		f.produce(recs...)
		now := time.Now()
		if !last.IsZero() {
			longestGap = max(longestGap, now.Sub(last))
		}
		last = now
		<-tick.C
	}
	return n, longestGap
}

// bulkLoadEnds records the reasons the indexer logs for ending the
// bulk-load mode of each index.
type bulkLoadEnds struct {
	mu sync.Mutex
	by map[string][]string
}

// recordBulkLoadEnds makes cfg's logger record the ends of bulk-load mode
// (and pass everything to the logger it had).
func recordBulkLoadEnds(cfg *Config) *bulkLoadEnds {
	e := &bulkLoadEnds{by: map[string][]string{}}
	cfg.Logger = slog.New(bulkLoadEndHandler{e: e, next: cfg.Logger.Handler()})
	return e
}

func (e *bulkLoadEnds) reasons(idx string) []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.by[idx]
}

type bulkLoadEndHandler struct {
	e    *bulkLoadEnds
	next slog.Handler
}

func (h bulkLoadEndHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h bulkLoadEndHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == bulkLoadEndedMessage {
		var idx, reason string
		r.Attrs(func(a slog.Attr) bool {
			switch a.Key {
			case "index":
				idx = a.Value.String()
			case "reason":
				reason = a.Value.String()
			}
			return true
		})
		h.e.mu.Lock()
		h.e.by[idx] = append(h.e.by[idx], reason)
		h.e.mu.Unlock()
	}
	if h.next.Enabled(ctx, r.Level) {
		return h.next.Handle(ctx, r)
	}
	return nil
}
func (h bulkLoadEndHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return bulkLoadEndHandler{e: h.e, next: h.next.WithAttrs(as)}
}
func (h bulkLoadEndHandler) WithGroup(g string) slog.Handler {
	return bulkLoadEndHandler{e: h.e, next: h.next.WithGroup(g)}
}

// Which partitions count, and when a load is over, without servers: every
// partition heard from in the current group generation must be caught up,
// and then either fewer than slack messages were fetched in the last second
// or BulkLoadMax has passed.
func TestBulkLoadIsOverWhenCaughtUpAndQuietOrPastMax(t *testing.T) {
	t.Parallel()
	b := newBulkLoads(Config{BatchSize: 50, BulkLoadMax: time.Minute})
	t0 := time.Now()
	b.add("g")
	b.gens["g"].since = t0
	gen1 := &generation{ended: make(chan struct{})}
	gen2 := &generation{ended: make(chan struct{})}
	d := func(g *generation, p int, off, hwm int64) *doc {
		return &doc{gen: g, msg: kafka.Message{Partition: p, Offset: off, HighWaterMark: hwm}}
	}
	b.sample(t0)
	b.noteFetched(1000)
	b.sample(t0.Add(time.Second))
	b.noteBatch([]*doc{d(gen1, 0, 99, 100), d(gen1, 1, 10, 500)})
	require.Nil(t, b.due(t0.Add(time.Second), nil), "partition 1 is behind")
	b.noteBatch([]*doc{d(gen1, 1, 480, 500)})
	require.Nil(t, b.due(t0.Add(time.Second), nil), "caught up, but 1000 messages were fetched in the last second")

	b.noteFetched(49)
	b.sample(t0.Add(2 * time.Second))
	b.noteBatch([]*doc{d(gen2, 2, 10, 500)})
	require.Nil(t, b.due(t0.Add(2*time.Second), nil), "quiet, but partition 2 of the new group generation is behind")
	close(gen1.ended)
	b.noteBatch([]*doc{d(gen1, 2, 499, 500)})
	require.Nil(t, b.due(t0.Add(2*time.Second), nil), "a batch of a group generation that is over says nothing")
	b.noteBatch([]*doc{d(gen2, 2, 499, 500)})
	require.Equal(t, map[string]string{"g": bulkLoadEndedLoadStopped}, b.due(t0.Add(2*time.Second), nil),
		"partitions 0 and 1 moved with the old group generation; 2 is caught up, and 49 messages were fetched in the last second")
	require.Nil(t, b.due(t0.Add(2*time.Second), nil), "being ended: not twice")
	b.failed("g")
	require.Len(t, b.due(t0.Add(2*time.Second), nil), 1, "a failed end is tried again")
	b.ended("g")
	require.False(t, b.active())

	b.add("h")
	b.gens["h"].since = t0
	b.noteFetched(1000)
	b.sample(t0.Add(3 * time.Second))
	require.Nil(t, b.due(t0.Add(3*time.Second), nil), "streaming, before BulkLoadMax")
	b.sample(t0.Add(time.Minute - time.Second))
	b.noteFetched(1000)
	require.Equal(t, map[string]string{"h": bulkLoadEndedMax}, b.due(t0.Add(time.Minute), nil), "streaming, at BulkLoadMax")

	b0 := newBulkLoads(Config{BatchSize: 50})
	b0.add("g")
	require.Nil(t, b0.due(time.Now(), nil), "BulkLoadMax 0: only a batch ends the mode")
	require.Nil(t, b0.due(time.Now(), []*doc{d(gen2, 0, 10, 500)}))
	require.Equal(t, map[string]string{"g": bulkLoadEndedFirstCatchUp}, b0.due(time.Now(), []*doc{d(gen2, 0, 480, 500)}))
}
