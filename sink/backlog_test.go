package sink

import (
	"context"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
)

// fakeClock is the backlog's clock in tests that call takeLocked
// directly: it only moves when the test says so.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time { return c.t }

func (c *fakeClock) advance(d time.Duration) time.Time {
	c.t = c.t.Add(d)
	return c.t
}

func newTestBacklog(lanes, batchSize int, flush time.Duration) (*backlog, *fakeClock) {
	c := &fakeClock{t: time.Unix(1_800_000_000, 0)}
	b := newBacklog(Config{Lanes: lanes, BatchSize: batchSize, BatchBytes: 1 << 20, FlushInterval: flush})
	b.now = c.now
	return b, c
}

func msgDoc(partition int, offset int64) *doc {
	return &doc{msg: kafka.Message{Partition: partition, Offset: offset}, id: "id", body: []byte(`{"n":1}`)}
}

// offsets lists a batch as partition → offsets, in batch order.
func offsets(bt *batch) map[int][]int64 {
	out := map[int][]int64{}
	for _, d := range bt.docs {
		out[d.msg.Partition] = append(out[d.msg.Partition], d.msg.Offset)
	}
	return out
}

func TestBacklogTakesTheOldestFreePartitionsFirst(t *testing.T) {
	t.Parallel()
	b, clock := newTestBacklog(2, 3, time.Second)
	ctx := context.Background()
	for o := range int64(4) {
		require.NoError(t, b.put(ctx, msgDoc(0, o)))
	}
	for p := 1; p <= 2; p++ {
		clock.advance(time.Millisecond)
		for o := range int64(2) {
			require.NoError(t, b.put(ctx, msgDoc(p, o)))
		}
	}

	first, wait := b.takeLocked(clock.now())
	require.Zero(t, wait)
	require.Equal(t, map[int][]int64{0: {0, 1, 2}}, offsets(first))
	// Partition 0 still holds the oldest message, but it is busy: the next
	// batch takes partition 1, then fills up from partition 2.
	second, _ := b.takeLocked(clock.now())
	require.Equal(t, map[int][]int64{1: {0, 1}, 2: {0}}, offsets(second))
	// Every partition is busy now; the rest of 2 is not free either.
	none, wait := b.takeLocked(clock.advance(time.Hour))
	require.Nil(t, none)
	require.Zero(t, wait)

	b.release(first)
	third, _ := b.takeLocked(clock.now())
	require.Equal(t, map[int][]int64{0: {3}}, offsets(third), "a partial batch once it has waited")
	b.release(second)
	fourth, _ := b.takeLocked(clock.now())
	require.Equal(t, map[int][]int64{2: {1}}, offsets(fourth))
	docs, bytes := b.stats()
	require.Zero(t, docs)
	require.Zero(t, bytes)
}

func TestBacklogFlushInterval(t *testing.T) {
	t.Parallel()
	b, clock := newTestBacklog(2, 100, 200*time.Millisecond)
	ctx := context.Background()
	require.NoError(t, b.put(ctx, msgDoc(1, 0)))
	inFlight, _ := b.takeLocked(clock.now())
	require.NotNil(t, inFlight)
	require.NoError(t, b.put(ctx, msgDoc(0, 0)))
	bt, wait := b.takeLocked(clock.advance(150 * time.Millisecond))
	require.Nil(t, bt, "a partial batch waits for the flush interval while another is in flight")
	require.Equal(t, 50*time.Millisecond, wait)
	bt, _ = b.takeLocked(clock.advance(wait))
	require.Equal(t, map[int][]int64{0: {0}}, offsets(bt))
}

// Group commit: with no batch in flight, a partial batch goes at once (an
// idle indexer does not add the flush interval to every change's latency);
// while one is in flight, the next gathers until it is released.
func TestBacklogIdleSendsAtOnce(t *testing.T) {
	t.Parallel()
	b, clock := newTestBacklog(2, 100, time.Hour)
	ctx := context.Background()
	require.NoError(t, b.put(ctx, msgDoc(0, 0)))
	first, wait := b.takeLocked(clock.now())
	require.Zero(t, wait)
	require.Equal(t, map[int][]int64{0: {0}}, offsets(first), "nothing in flight: a partial batch goes at once")

	require.NoError(t, b.put(ctx, msgDoc(1, 0)))
	require.NoError(t, b.put(ctx, msgDoc(1, 1)))
	bt, wait := b.takeLocked(clock.advance(time.Millisecond))
	require.Nil(t, bt, "a batch in flight: the next one gathers")
	require.Equal(t, time.Hour-time.Millisecond, wait)

	b.release(first)
	bt, _ = b.takeLocked(clock.now())
	require.Equal(t, map[int][]int64{1: {0, 1}}, offsets(bt), "released: what gathered goes at once")
}

// A fetch's messages are put one by one; an idle lane waits for the rest of
// them instead of sending the first alone.
func TestBacklogWaitsForTheRestOfADelivery(t *testing.T) {
	t.Parallel()
	b, clock := newTestBacklog(1, 100, time.Hour)
	ctx := context.Background()
	done := b.deliver()
	require.NoError(t, b.put(ctx, msgDoc(0, 0)))
	bt, wait := b.takeLocked(clock.now())
	require.Nil(t, bt, "mid-delivery")
	require.Equal(t, time.Hour, wait)
	require.NoError(t, b.put(ctx, msgDoc(0, 1)))
	done()
	bt, _ = b.takeLocked(clock.now())
	require.Equal(t, map[int][]int64{0: {0, 1}}, offsets(bt))

	// A lane waiting in take is woken by the end of the delivery.
	done = b.deliver()
	require.NoError(t, b.put(ctx, msgDoc(1, 0)))
	b.release(bt)
	got := make(chan *batch)
	go func() {
		bt, err := b.take(ctx)
		if err == nil {
			got <- bt
		}
	}()
	for {
		b.mu.Lock()
		waiting := b.takers
		b.mu.Unlock()
		if waiting == 1 {
			break
		}
		runtime.Gosched()
	}
	done()
	select {
	case bt := <-got:
		require.Equal(t, map[int][]int64{1: {0}}, offsets(bt))
	case <-time.After(10 * time.Second):
		t.Fatal("the end of the delivery did not wake the waiting lane")
	}
}

func TestBacklogBatchBytes(t *testing.T) {
	t.Parallel()
	b, clock := newTestBacklog(1, 100, time.Hour)
	b.batchBytes = 2*docSize(msgDoc(0, 0)) + 1
	for o := range int64(5) {
		require.NoError(t, b.put(context.Background(), msgDoc(0, o)))
	}
	bt, _ := b.takeLocked(clock.now())
	require.Equal(t, map[int][]int64{0: {0, 1, 2}}, offsets(bt), "the document that crosses BatchBytes is the last one")
}

// The fetch loop waits while the backlog holds Lanes × backlogBatches
// batches, and goes on once a lane took one.
func TestBacklogBound(t *testing.T) {
	t.Parallel()
	b, _ := newTestBacklog(1, 2, time.Hour)
	ctx := context.Background()
	for o := range int64(backlogBatches * 2) {
		require.NoError(t, b.put(ctx, msgDoc(0, o)))
	}
	full, cancel := context.WithCancel(ctx)
	cancel()
	require.ErrorIs(t, b.put(full, msgDoc(0, 99)), context.Canceled, "put must wait on a full backlog")
	bt, err := b.take(ctx)
	require.NoError(t, err)
	require.Len(t, bt.docs, 2)
	require.NoError(t, b.put(full, msgDoc(0, 8)), "room for a batch again")
}

// Lanes taking and releasing concurrently while messages arrive: no
// partition is ever in two batches at once, and every partition's
// messages come out once each, in offset order.
func TestBacklogConcurrentLanesKeepPartitionOrder(t *testing.T) {
	t.Parallel()
	const lanes, partitions, perPartition = 4, 7, 400
	b := newBacklog(Config{Lanes: lanes, BatchSize: 9, BatchBytes: 1 << 20, FlushInterval: time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	var mu sync.Mutex
	held := map[int]bool{}
	next := map[int]int64{}
	seen := 0
	var problems []string
	var wg sync.WaitGroup
	for range lanes {
		wg.Go(func() {
			for {
				bt, err := b.take(ctx)
				if err != nil {
					return
				}
				mu.Lock()
				for p, offs := range offsets(bt) {
					if held[p] {
						problems = append(problems, "partition in two batches at once")
					}
					held[p] = true
					for _, o := range offs {
						if o != next[p] {
							problems = append(problems, "offset out of order")
						}
						next[p] = o + 1
						seen++
					}
				}
				done := seen == partitions*perPartition
				mu.Unlock()
				runtime.Gosched() // as if indexing: let the other lanes run
				mu.Lock()
				for p := range offsets(bt) {
					held[p] = false
				}
				mu.Unlock()
				b.release(bt)
				if done {
					cancel()
				}
			}
		})
	}
	for o := range int64(perPartition) {
		for p := range partitions {
			require.NoError(t, b.put(ctx, msgDoc(p, o)))
		}
	}
	wg.Wait()
	require.Empty(t, problems)
	require.Equal(t, partitions*perPartition, seen)
	for p := range partitions {
		require.Equal(t, int64(perPartition), next[p])
	}
}

// When a group generation ends, its buffered messages go; a partition
// whose batch is in flight stays busy, so the next generation's messages of
// that partition are taken only after the batch is released.
func TestBacklogDropsAnEndedGeneration(t *testing.T) {
	t.Parallel()
	b, clock := newTestBacklog(2, 2, time.Second)
	ctx := context.Background()
	old, next := &generation{id: 1}, &generation{id: 2}
	put := func(g *generation, p int, o int64) {
		d := msgDoc(p, o)
		d.gen = g
		require.NoError(t, b.put(ctx, d))
	}
	for o := range int64(3) {
		put(old, 0, o)
		put(old, 1, o)
	}
	inFlight, _ := b.takeLocked(clock.now())
	got := offsets(inFlight)
	require.Len(t, got, 1)
	busy := -1 // the partition in flight: either, they waited as long
	for p := range got {
		busy = p
	}
	other := 1 - busy
	require.Equal(t, map[int][]int64{busy: {0, 1}}, got)
	require.Equal(t, 4, b.drop(old))
	docs, bytes := b.stats()
	require.Zero(t, docs)
	require.Zero(t, bytes)

	put(next, 0, 0) // read again from the committed offset
	put(next, 1, 0)
	bt, _ := b.takeLocked(clock.advance(time.Hour))
	require.Equal(t, map[int][]int64{other: {0}}, offsets(bt), "partition %d is still busy", busy)
	b.release(inFlight)
	bt, _ = b.takeLocked(clock.now())
	require.Equal(t, map[int][]int64{busy: {0}}, offsets(bt))
	require.Zero(t, b.freeDocs)
	require.Zero(t, b.freeBytes)
}

// With Linger, a partial batch waits the flush interval even with nothing
// in flight (the batching before group commit).
func TestBacklogLingerWaitsWhenIdle(t *testing.T) {
	t.Parallel()
	b, clock := newTestBacklog(1, 100, 200*time.Millisecond)
	b.linger = true
	require.NoError(t, b.put(context.Background(), msgDoc(0, 0)))
	bt, wait := b.takeLocked(clock.advance(50 * time.Millisecond))
	require.Nil(t, bt)
	require.Equal(t, 150*time.Millisecond, wait)
	bt, _ = b.takeLocked(clock.advance(wait))
	require.Equal(t, map[int][]int64{0: {0}}, offsets(bt))
}

// One fetch holds thousands of records of each partition. Put one partition
// after the other, they filled the backlog with the first partition alone:
// its batch made it busy, the second lane found nothing free and the
// fetcher waited behind the full backlog, so one bulk was in flight at a
// time. Interleaved, every lane finds a batch of its own partition.
func TestAFetchOfSeveralPartitionsFeedsEveryLane(t *testing.T) {
	t.Parallel()
	cfg := Config{Brokers: []string{"127.0.0.1:9"}, URL: "http://127.0.0.1:9", Lanes: 2, BatchSize: 100, FlushInterval: time.Hour}.withDefaults()
	ix := &Indexer{cfg: cfg, rules: newRecordRules(cfg)}
	bl := newBacklog(cfg)
	var parts []kgo.FetchTopicPartition
	for p := range int32(4) {
		fp := kgo.FetchTopicPartition{Topic: "t", FetchPartition: kgo.FetchPartition{Partition: p, HighWatermark: 10_000}}
		for o := range int64(1000) {
			fp.Records = append(fp.Records, &kgo.Record{Topic: "t", Partition: p, Offset: o, Key: []byte("k"), Value: []byte(`{"n":1}`),
				Headers: []kgo.RecordHeader{{Key: "ce_type", Value: []byte("outboxrelay.upsert")}, {Key: "ce_aggregateversion", Value: []byte("1")}}})
		}
		parts = append(parts, fp)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	putDone := make(chan error, 1)
	go func() {
		// As fetch does: while a fetch is being put, a lane waits for a
		// full batch.
		delivered := bl.deliver()
		defer delivered()
		putDone <- ix.putInterleaved(ctx, &generation{}, parts, bl)
	}()

	// Two lanes, each holding its batch (no release): both get one, of
	// different partitions, while the fetch is still being put.
	tctx, tcancel := context.WithTimeout(ctx, 10*time.Second)
	defer tcancel()
	first, err := bl.take(tctx)
	require.NoError(t, err)
	second, err := bl.take(tctx)
	require.NoError(t, err, "the second lane found no free partition")
	require.Len(t, first.docs, 100)
	require.Len(t, second.docs, 100)
	require.NotEqual(t, first.docs[0].msg.Partition, second.docs[0].msg.Partition)
	for _, bt := range []*batch{first, second} {
		for i, d := range bt.docs {
			require.Equal(t, int64(i), d.msg.Offset, "each partition in offset order")
		}
	}
	cancel()
	require.ErrorIs(t, <-putDone, context.Canceled)
}
