package sink

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/outboxrelay/outboxrelay/index"
)

// A generation the router finds in bulk-load mode (see
// [index.FinishBulkLoad]) stays in it while a load streams into it, and
// leaves it once the indexer has caught up with its partitions and:
//
//   - the load has stopped: fewer than one batch (BatchSize messages) was
//     fetched in the last second, whether the topic went quiet or carries
//     a live trickle of changes; or
//   - BulkLoadMax has passed since this indexer first found the generation
//     in the mode: a stream that never stops (live changes above BatchSize
//     a second into a new generation) does not keep it unsearchable; or
//   - with BulkLoadMax 0, at the first batch that catches up (the
//     behaviour before BulkLoadMax: in a first fill the indexer keeps up
//     from the start, so the mode ended in the first second).
//
// Caught up alone is not enough: the indexer of a first fill is caught up
// with the batcher from its first second. The load stopping alone is not
// enough either: an indexer held up by the engine fetches little while far
// behind. Lanes check after each batch they resolve; when the topic goes
// quiet no batch arrives, so a ticker checks too, every
// bulkLoadCheckInterval while some generation is in the mode.
//
// Each indexer decides from its own partitions and fetches; the mode is
// the index's, so the first indexer whose share of the load is over ends
// it for all. Documents that arrive after the end are searchable within
// the restored refresh interval.

// bulkLoadCheckInterval is how often the ticker checks whether a load is
// over.
const bulkLoadCheckInterval = 250 * time.Millisecond

// bulkLoadQuietWindow is how far back "the load has stopped" looks.
const bulkLoadQuietWindow = time.Second

// The log line that says a generation left bulk-load mode, and its reasons.
const (
	bulkLoadEndedMessage      = "index generation out of bulk-load mode: refresh and replicas restored"
	bulkLoadEndedLoadStopped  = "caught up and the load stopped"
	bulkLoadEndedMax          = "caught up and BULK_LOAD_MAX reached"
	bulkLoadEndedFirstCatchUp = "first caught-up batch (BULK_LOAD_MAX=0)"
)

// caughtUp reports whether the batch brought every partition it holds to
// within one batch (slack messages) of the partition's high watermark when
// its last message was fetched. Not "at the high watermark": under a steady
// stream a full batch often ends partway through one of its partitions, and
// a first generation would stay unrefreshed, so unsearchable, for as long as
// the stream lasted.
func caughtUp(docs []*doc, slack int) bool {
	last := map[int]*doc{}
	for _, d := range docs {
		last[d.msg.Partition] = d
	}
	for _, d := range last {
		if d.msg.HighWaterMark-(d.msg.Offset+1) >= int64(slack) {
			return false
		}
	}
	return len(last) > 0
}

// bulkLoads is what the router knows of the generations in bulk-load mode
// and of whether their load is over.
type bulkLoads struct {
	max time.Duration // Config.BulkLoadMax
	// slack (BatchSize) is how far from a partition's end still counts as
	// caught up, and how many messages a second mean the load still streams.
	slack   int
	fetched atomic.Int64  // messages the fetcher put into the backlog, ever
	wake    chan struct{} // a generation was found in the mode: the ticker starts

	mu   sync.Mutex
	gens map[string]*bulkGen // by index name
	// parts is whether each partition was caught up after its last
	// resolved batch. The partitions that count are those heard from in
	// the group generation this indexer resolved a batch of last: a batch
	// of another generation starts afresh (the partitions may have moved
	// to other members, which then decide for them), a batch of a
	// generation that is over is ignored, and a partition not heard from
	// had nothing to read. The state of a generation that ended stays
	// until a batch of the next arrives: a load that ends just before a
	// rebalance, with the topic quiet after it, is still seen to be over.
	parts    map[int]bool
	partsGen *generation
	samples  []fetchSample // the fetched count every tick, for the last second
}

// bulkGen is a generation found in bulk-load mode.
type bulkGen struct {
	since  time.Time // when this indexer first found it in the mode
	ending bool      // a lane or the ticker is ending the mode
}

type fetchSample struct {
	at time.Time
	n  int64 // bulkLoads.fetched at that time
}

func newBulkLoads(cfg Config) *bulkLoads {
	return &bulkLoads{max: cfg.BulkLoadMax, slack: cfg.BatchSize, wake: make(chan struct{}, 1), gens: map[string]*bulkGen{}, parts: map[int]bool{}}
}

// add records that idx is in bulk-load mode. A generation already known
// keeps its start: route finds it again every routeTTL.
func (b *bulkLoads) add(idx string) {
	b.mu.Lock()
	if b.gens[idx] == nil {
		b.gens[idx] = &bulkGen{since: time.Now()}
	}
	b.mu.Unlock()
	select {
	case b.wake <- struct{}{}:
	default:
	}
}

// noteFetched counts n messages put into the backlog.
func (b *bulkLoads) noteFetched(n int) { b.fetched.Add(int64(n)) }

// noteBatch records how far behind the end of its partitions a resolved
// batch left them.
func (b *bulkLoads) noteBatch(docs []*doc) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, d := range docs {
		if g := d.gen; g != nil && g != b.partsGen {
			select {
			case <-g.ended:
				continue // its partitions' current owners decide for them
			default:
			}
			clear(b.parts)
			b.partsGen = g
		}
		b.parts[d.msg.Partition] = d.msg.HighWaterMark-(d.msg.Offset+1) < int64(b.slack)
	}
}

// active reports whether some generation is in bulk-load mode.
func (b *bulkLoads) active() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.gens) > 0
}

// sample records the fetched count at now and forgets the samples that no
// longer start the quiet window.
func (b *bulkLoads) sample(now time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.samples = append(b.samples, fetchSample{at: now, n: b.fetched.Load()})
	for len(b.samples) > 1 && now.Sub(b.samples[1].at) >= bulkLoadQuietWindow {
		b.samples = b.samples[1:]
	}
}

func (b *bulkLoads) resetSamples() {
	b.mu.Lock()
	b.samples = nil
	b.mu.Unlock()
}

// quiet reports whether fewer than slack messages were fetched since the
// newest sample at least bulkLoadQuietWindow old (a window of 1 s to 1 s
// plus a tick). Without such a sample (the ticker started less than a
// second ago) the load is taken to be streaming. b.mu is held.
func (b *bulkLoads) quiet(now time.Time) bool {
	var from *fetchSample
	for i := range b.samples {
		if now.Sub(b.samples[i].at) >= bulkLoadQuietWindow {
			from = &b.samples[i]
		}
	}
	return from != nil && b.fetched.Load()-from.n < int64(b.slack)
}

// allCaughtUp reports whether every partition that counts (see parts) was
// caught up after its last batch. b.mu is held.
func (b *bulkLoads) allCaughtUp() bool {
	for _, ok := range b.parts {
		if !ok {
			return false
		}
	}
	return len(b.parts) > 0
}

// due returns the generations whose bulk-load mode is over, each with the
// reason, and marks them as ending. batch is the batch a lane has just
// resolved (and noted), nil for the ticker.
func (b *bulkLoads) due(now time.Time, batch []*doc) map[string]string {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.gens) == 0 {
		return nil
	}
	var reason string // for every generation; "" = those past max
	switch {
	case b.max == 0:
		if !caughtUp(batch, b.slack) {
			return nil
		}
		reason = bulkLoadEndedFirstCatchUp
	case !b.allCaughtUp():
		return nil
	case b.quiet(now):
		reason = bulkLoadEndedLoadStopped
	}
	var out map[string]string
	for idx, g := range b.gens {
		r := reason
		if r == "" && now.Sub(g.since) >= b.max {
			r = bulkLoadEndedMax
		}
		if g.ending || r == "" {
			continue
		}
		g.ending = true
		if out == nil {
			out = map[string]string{}
		}
		out[idx] = r
	}
	return out
}

// ended forgets idx, out of bulk-load mode, and returns how long this
// indexer knew it in the mode.
func (b *bulkLoads) ended(idx string) time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	g := b.gens[idx]
	delete(b.gens, idx)
	if g == nil {
		return 0
	}
	return time.Since(g.since)
}

// failed leaves idx in bulk-load mode, for the next check to try again.
func (b *bulkLoads) failed(idx string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if g := b.gens[idx]; g != nil {
		g.ending = false
	}
}

// finishBulkLoads notes how far the batch a lane resolved brought its
// partitions, and ends the bulk-load mode of the generations whose load is
// over.
func (r *router) finishBulkLoads(ctx context.Context, docs []*doc) {
	r.bulk.noteBatch(docs)
	r.endBulkLoads(ctx, r.bulk.due(time.Now(), docs))
}

// watchBulkLoads checks every bulkLoadCheckInterval, while some generation
// is in bulk-load mode, whether its load is over, until ctx ends. With
// BulkLoadMax 0 only a batch ends the mode, and it does nothing.
func (r *router) watchBulkLoads(ctx context.Context) {
	if r.bulk.max == 0 {
		return
	}
	for {
		select {
		case <-r.bulk.wake:
		case <-ctx.Done():
			return
		}
		tick := time.NewTicker(bulkLoadCheckInterval)
		for r.bulk.active() {
			now := time.Now()
			r.bulk.sample(now)
			r.endBulkLoads(ctx, r.bulk.due(now, nil))
			select {
			case <-tick.C:
			case <-ctx.Done():
				tick.Stop()
				return
			}
		}
		tick.Stop()
		r.bulk.resetSamples()
	}
}

// endBulkLoads takes the generations of due out of bulk-load mode. A
// failure is logged and tried again at the next check.
func (r *router) endBulkLoads(ctx context.Context, due map[string]string) {
	for idx, reason := range due {
		b := backoff.WithContext(backoff.WithMaxRetries(backoff.NewExponentialBackOff(backoff.WithInitialInterval(200*time.Millisecond)), 3), ctx)
		err := backoff.Retry(func() error {
			err := index.FinishBulkLoad(ctx, r.client, idx)
			if err != nil && !index.IsRetryable(err) {
				return backoff.Permanent(err)
			}
			return err
		}, b)
		if err != nil {
			r.bulk.failed(idx)
			if ctx.Err() != nil {
				continue // stopping: the next indexer finds the mode in the _meta
			}
			r.log.Warn("could not end the bulk load of an index generation (tried again at the next check)",
				slog.String("index", idx), slog.String("reason", reason), slog.Any("error", err))
			continue
		}
		in := r.bulk.ended(idx)
		r.log.Info(bulkLoadEndedMessage, slog.String("index", idx), slog.String("reason", reason), slog.Duration("in_mode", in))
	}
}
