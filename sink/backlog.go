package sink

import (
	"context"
	"slices"
	"sync"
	"time"
)

// backlogBatches is how many batches per lane the backlog holds before the
// fetch loop waits: enough that a lane always finds its next batch ready
// while the reader delivers one partition's messages in runs of thousands,
// and that a bulk the engine holds up for a few hundred milliseconds does
// not stop the fetching for the other lanes. Memory: up to Lanes ×
// backlogBatches × BatchBytes of documents, plus the batches in flight,
// plus the fetch being put and the one franz-go reads meanwhile (each up
// to its FetchMaxBytes, 50 MiB by default, compressed).
const backlogBatches = 4

// backlog holds the fetched messages per partition until a lane takes them
// as a batch. A partition is busy while a batch with its messages is being
// resolved: no other batch takes its messages until that lane releases it,
// so a partition's messages are resolved in offset order, one batch after
// the other, while any free lane serves the other partitions.
type backlog struct {
	batchDocs, batchBytes int
	flushInterval         time.Duration
	linger                bool
	maxDocs, maxBytes     int // the fetch loop waits above these
	now                   func() time.Time

	mu    sync.Mutex
	parts map[int]*partBacklog
	// docs and bytes count every buffered message; freeDocs and freeBytes
	// only those of partitions that are not busy (the ones a lane may take).
	docs, bytes, freeDocs, freeBytes int
	takers                           int // lanes waiting in take
	inflight                         int // batches taken and not released
	delivering                       bool
	scratch                          []*partBacklog

	ready chan struct{} // a waiting lane may find a batch now
	space chan struct{} // the fetch loop may add again
}

type partBacklog struct {
	id    int
	docs  []*doc // oldest first
	bytes int
	busy  bool
}

// batch is what a lane takes: documents of one or more partitions, each
// partition's in offset order, and those partitions stay busy until
// [backlog.release].
type batch struct {
	docs  []*doc
	parts []*partBacklog
}

func newBacklog(cfg Config) *backlog {
	return &backlog{
		batchDocs:     cfg.BatchSize,
		batchBytes:    cfg.BatchBytes,
		flushInterval: cfg.FlushInterval,
		linger:        cfg.Linger,
		maxDocs:       cfg.Lanes * backlogBatches * cfg.BatchSize,
		maxBytes:      cfg.Lanes * backlogBatches * cfg.BatchBytes,
		now:           time.Now,
		parts:         map[int]*partBacklog{},
		ready:         make(chan struct{}, 1),
		space:         make(chan struct{}, 1),
	}
}

// docSize is what a document adds to a bulk request, roughly: the body, the
// action line and the reconcile fields; and what it holds in the backlog. A
// message that will be dead-lettered has no body but keeps its value, so the
// larger of the two counts, and the backlog's byte cap holds for it too.
func docSize(d *doc) int { return max(len(d.body), len(d.msg.Value)) + len(d.id) + 120 }

func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// put adds a fetched message. It waits while the backlog is full (but
// always accepts a message into an empty one, however large).
func (b *backlog) put(ctx context.Context, d *doc) error {
	d.fetched = b.now()
	n := docSize(d)
	for {
		b.mu.Lock()
		if b.docs == 0 || (b.docs < b.maxDocs && b.bytes < b.maxBytes) {
			break
		}
		b.mu.Unlock()
		select {
		case <-b.space:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	defer b.mu.Unlock()
	p := b.parts[d.msg.Partition]
	if p == nil {
		p = &partBacklog{id: d.msg.Partition}
		b.parts[p.id] = p
	}
	p.docs = append(p.docs, d)
	p.bytes += n
	b.docs++
	b.bytes += n
	if p.busy {
		return nil
	}
	b.freeDocs++
	b.freeBytes += n
	// A waiting lane needs to know when a batch is full, and when the first
	// message arrives (it then starts the flush interval).
	if b.takers > 0 && (b.freeDocs == 1 || b.freeDocs >= b.batchDocs || b.freeBytes >= b.batchBytes) {
		signal(b.ready)
	}
	return nil
}

// deliver marks the start of one fetch's messages, put one by one, and
// returns the function that marks their end. While a fetch is being put, a
// partial batch waits (up to FlushInterval) for the rest of it.
func (b *backlog) deliver() (done func()) {
	b.mu.Lock()
	b.delivering = true
	b.mu.Unlock()
	return func() {
		b.mu.Lock()
		defer b.mu.Unlock()
		b.delivering = false
		if b.takers > 0 && b.freeDocs > 0 {
			signal(b.ready)
		}
	}
}

// take waits for a batch: BatchSize documents or BatchBytes from partitions
// that are not busy, or less once the oldest of them has waited
// FlushInterval, or at once when no batch is in flight and no fetch is
// being put (group commit: an idle indexer sends what it has, a busy one
// gathers while its bulks are in the engine; not with Linger). It takes the partitions whose
// oldest message came first first, which is the order the reader delivered
// them in, so no partition falls behind for long.
func (b *backlog) take(ctx context.Context) (*batch, error) {
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		b.mu.Lock()
		bt, wait := b.takeLocked(b.now())
		if bt != nil {
			if b.takers > 0 && b.freeDocs > 0 {
				signal(b.ready) // perhaps another batch for another lane
			}
			b.mu.Unlock()
			signal(b.space)
			return bt, nil
		}
		b.takers++
		b.mu.Unlock()
		var expired <-chan time.Time
		if wait > 0 {
			if timer == nil {
				timer = time.NewTimer(wait)
			} else {
				timer.Reset(wait)
			}
			expired = timer.C
		}
		select {
		case <-b.ready:
		case <-expired:
		case <-ctx.Done():
		}
		b.mu.Lock()
		b.takers--
		b.mu.Unlock()
		if err := ctx.Err(); err != nil {
			return nil, err
		}
	}
}

// takeLocked returns a batch, or nil and how long until the oldest free
// message has waited FlushInterval (0: nothing to wait for).
func (b *backlog) takeLocked(now time.Time) (*batch, time.Duration) {
	if b.freeDocs == 0 {
		return nil, 0
	}
	free := b.scratch[:0]
	for _, p := range b.parts {
		if !p.busy && len(p.docs) > 0 {
			free = append(free, p)
		}
	}
	b.scratch = free
	if len(free) == 0 {
		return nil, 0
	}
	slices.SortFunc(free, func(x, y *partBacklog) int { return x.docs[0].fetched.Compare(y.docs[0].fetched) })
	idle := !b.linger && b.inflight == 0 && !b.delivering
	if waited := now.Sub(free[0].docs[0].fetched); !idle && b.freeDocs < b.batchDocs && b.freeBytes < b.batchBytes && waited < b.flushInterval {
		return nil, b.flushInterval - waited
	}
	b.inflight++
	bt := &batch{docs: make([]*doc, 0, min(b.freeDocs, b.batchDocs))}
	size := 0
	for _, p := range free {
		if len(bt.docs) >= b.batchDocs || size >= b.batchBytes {
			break
		}
		k, taken := 0, 0
		for k < len(p.docs) && len(bt.docs) < b.batchDocs && size < b.batchBytes {
			n := docSize(p.docs[k])
			bt.docs = append(bt.docs, p.docs[k])
			size += n
			taken += n
			k++
		}
		clear(p.docs[:k]) // the backing array outlives the taken documents
		p.docs = p.docs[k:]
		if len(p.docs) == 0 {
			p.docs = nil
		}
		p.bytes -= taken
		p.busy = true
		b.docs -= k
		b.bytes -= taken
		// The rest of the partition is no longer free either.
		b.freeDocs -= k + len(p.docs)
		b.freeBytes -= taken + p.bytes
		bt.parts = append(bt.parts, p)
	}
	clear(b.scratch)
	return bt, 0
}

// release makes the batch's partitions free again. Call it once the batch
// is resolved and queued for its commit, so that the commits of one
// partition stay in order.
func (b *backlog) release(bt *batch) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.inflight--
	for _, p := range bt.parts {
		p.busy = false
		b.freeDocs += len(p.docs)
		b.freeBytes += p.bytes
	}
	if b.takers > 0 && b.freeDocs > 0 {
		signal(b.ready)
	}
}

// drop removes the buffered messages fetched in generation g, which has
// ended, and returns how many it removed. Batches already taken are not
// touched: their partitions stay busy until released, so a partition's
// messages of the next generation are still resolved after them.
func (b *backlog) drop(g *generation) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	dropped := 0
	for _, p := range b.parts {
		kept := p.docs[:0]
		for _, d := range p.docs {
			if d.gen != g {
				kept = append(kept, d)
				continue
			}
			n := docSize(d)
			p.bytes -= n
			b.docs--
			b.bytes -= n
			if !p.busy {
				b.freeDocs--
				b.freeBytes -= n
			}
			dropped++
		}
		clear(p.docs[len(kept):])
		p.docs = kept
		if len(p.docs) == 0 {
			p.docs = nil
		}
	}
	signal(b.space)
	return dropped
}

// stats returns the buffered documents and bytes (tests).
func (b *backlog) stats() (docs, bytes int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.docs, b.bytes
}
