package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/outboxrelay/outboxrelay/internal/kafkakey"
)

// shardWorker publishes one leased shard: one batch at a time, so one key's
// events never overtake each other.
type shardWorker struct {
	shard    int
	epoch    int64
	cancel   context.CancelFunc
	done     chan struct{}
	wake     chan struct{}
	deadline atomic.Int64 // Publisher.now() after which the lease may be gone
	failing  atomic.Bool
	idle     atomic.Bool // the shard was empty at the last read: waiting for a wake-up
	// readLimit is how many rows a read asks for: BatchSize, or fewer when
	// that many would not fit in one call (see fit). Shard goroutine only.
	readLimit int
	lane      int // index into Publisher.lanes
	writer    *kafka.Writer
	log       *slog.Logger
}

func (w *shardWorker) wakeUp() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

func (w *shardWorker) exited() bool {
	select {
	case <-w.done:
		return true
	default:
		return false
	}
}

// startWorker runs a worker for a freshly held lease. Called with p.mu held.
func (p *Publisher) startWorker(parent context.Context, l lease, deadline time.Duration) *shardWorker {
	ctx, cancel := context.WithCancel(parent)
	w := &shardWorker{
		shard:  l.shard,
		epoch:  l.epoch,
		cancel: cancel,
		done:   make(chan struct{}),
		wake:   make(chan struct{}, 1),

		readLimit: cmp.Or(int(p.readLimit.Load()), p.firstReadLimit()),
		lane:      p.pickLane(),
		log:       p.log.With(slog.Int("shard", l.shard), slog.Int64("epoch", l.epoch)),
		// One writer per shard: its partition batches never mix with another
		// shard's, so each call's messages for a partition go out in a single
		// produce request (see doc.go).
		writer: &kafka.Writer{
			Addr:         kafka.TCP(p.cfg.Brokers...),
			Balancer:     kafkakey.Balancer(),
			RequiredAcks: kafka.RequireAll,
			BatchSize:    p.cfg.BatchSize,
			BatchBytes:   int64(p.cfg.BatchBytes),
			BatchTimeout: p.cfg.BatchTimeout,
			WriteTimeout: p.cfg.WriteTimeout,
			ReadTimeout:  p.cfg.WriteTimeout,
			// kafka-go's own retries sleep without a context and would hide
			// an outage; the publisher retries with backoff instead.
			MaxAttempts:            1,
			Transport:              p.transport,
			AllowAutoTopicCreation: true,
		},
	}
	w.deadline.Store(int64(deadline))
	w.wake <- struct{}{} // look at the shard once at start
	p.workers[l.shard] = w
	p.wg.Add(1)
	p.laneLoad[w.lane]++
	go func() {
		defer p.wg.Done()
		defer close(w.done)
		defer func() {
			p.mu.Lock()
			p.laneLoad[w.lane]--
			p.mu.Unlock()
		}()
		defer w.writer.Close()
		defer p.setFailing(w, false, nil)
		p.runShard(ctx, w)
	}()
	return w
}

// valid reports whether the lease is certainly still ours.
func (p *Publisher) valid(w *shardWorker) bool { return p.now() < time.Duration(w.deadline.Load()) }

func (p *Publisher) runShard(ctx context.Context, w *shardWorker) {
	failures := 0
	var events *batch
	fresh := false // events were read after the last batch was recorded
	for ctx.Err() == nil {
		if !p.valid(w) {
			// Heartbeats are failing (database down?): send nothing until a
			// renewal proves the lease is still ours.
			fresh = false
			if !sleep(ctx, p.cfg.LeaseTTL/10) {
				return
			}
			continue
		}
		var err error
		if !fresh {
			if events, err = p.read(ctx, w); err != nil {
				p.m.errors.WithLabelValues(errKindDatabase).Inc()
				err = fmt.Errorf("read shard %d: %w", w.shard, err)
			}
		}
		if err == nil && events.len() > 0 {
			// The round trip that records this batch also reads the next
			// one, so a busy shard costs one query per batch.
			events, err = p.publishBatch(ctx, w, events)
		}
		fresh = err == nil
		switch {
		case errors.Is(err, ErrLeaseLost):
			p.m.errors.WithLabelValues(errKindLeaseLost).Inc()
			w.log.Warn("lease lost while publishing; stopping the shard")
			return
		case errors.Is(err, errLeaseExpired), ctx.Err() != nil:
			continue
		case err != nil:
			failures++
			w.log.Warn("publish batch failed; starting over from the outbox", slog.String("error", err.Error()), slog.Int("failures", failures))
			if !sleep(ctx, min(time.Duration(failures)*time.Second, 10*time.Second)) {
				return
			}
			continue
		}
		failures = 0
		if events.len() > 0 {
			continue // more is waiting: never wait on a timer while busy
		}
		w.idle.Store(true)
		select {
		case <-ctx.Done():
			return
		case <-w.wake:
			w.idle.Store(false)
			fresh = false
		}
	}
}

// errLeaseExpired: the local lease deadline passed during a retry loop.
var errLeaseExpired = errors.New("shard lease not renewed in time")

type pendingEvent struct {
	ev   *storedEvent
	msg  kafka.Message
	err  error // set when the event is dead
	code int32
}

// batch is one read of a shard: its events, the memory their columns were
// copied into, and what their records are built with. Batches come from
// batchPool and go back to it once published and recorded, so a busy shard
// reuses the same few megabytes instead of allocating them batch after
// batch (and the garbage collector has that much less to do).
type batch struct {
	events []storedEvent
	rows   arena // the events' variable-length columns
	rb     recordBuilder
	all    []pendingEvent
	msgs   []kafka.Message // the records of a WriteMessages call
}

var batchPool = sync.Pool{New: func() any { return new(batch) }}

func (b *batch) len() int {
	if b == nil {
		return 0
	}
	return len(b.events)
}

// release gives b back for reuse. Nothing may use b or anything built from
// it afterwards: the next batch overwrites its rows' bytes and its records.
// So only a batch that kafka-go is certainly done with may be released; any
// other is left to the garbage collector (see publishBatch).
func (b *batch) release() {
	clear(b.events)
	b.events = b.events[:0]
	b.rows.reset()
	clear(b.all)
	b.all = b.all[:0]
	clear(b.rb.slab)
	clear(b.msgs)
	b.msgs = b.msgs[:0]
	batchPool.Put(b)
}

// publishBatch sends and records one batch read from the shard, and returns
// the shard's next batch, read in the same round trip as the recording.
func (p *Publisher) publishBatch(ctx context.Context, w *shardWorker, b *batch) (*batch, error) {
	events := b.events
	// Keep the call under BatchBytes so kafka-go sends each partition's
	// share as one request; the rest of the rows come with the next read.
	rb := &b.rb
	rb.reset(p.cfg.Source, len(events))
	all := slices.Grow(b.all[:0], len(events))
	bytes := 0
	for i := range events {
		pe := pendingEvent{ev: &events[i]}
		pe.msg, pe.err = rb.record(pe.ev)
		if pe.err == nil {
			size := messageSize(&pe.msg)
			if size > p.cfg.BatchBytes {
				pe.err = fmt.Errorf("%w: %d bytes, limit %d (BATCH_BYTES; broker message.max.bytes): %w", ErrMessageTooLarge, size, p.cfg.BatchBytes, kafka.MessageSizeTooLarge)
				pe.code = int32(kafka.MessageSizeTooLarge)
			} else if bytes+size > p.cfg.BatchBytes {
				break
			} else {
				bytes += size
			}
		}
		all = append(all, pe)
	}
	p.fit(w, len(all), len(events), bytes)
	b.all = all
	ctx, span := startPublishSpan(ctx, all)
	defer span.End()

	retried, err := p.produce(ctx, w, b)
	if err != nil {
		return nil, err
	}
	acked := time.Now()

	var ids, deadIDs []int64
	var deadErrs []string
	var deadCodes []int32
	ids = make([]int64, 0, len(all))
	for i := range all {
		pe := &all[i]
		if pe.err != nil {
			deadIDs = append(deadIDs, pe.ev.id)
			deadErrs = append(deadErrs, pe.err.Error())
			deadCodes = append(deadCodes, pe.code)
			w.log.Error("event rejected permanently; moved to outbox_dead_letters",
				slog.String("event_id", string(pe.ev.eventID)), slog.String("aggregate_id", string(pe.ev.aggregateID)), slog.String("error", pe.err.Error()))
			continue
		}
		ids = append(ids, pe.ev.id)
	}
	next, err := p.record(ctx, w, ids, deadIDs, deadErrs, deadCodes)
	if err != nil {
		return nil, err
	}
	p.m.published.Add(float64(len(ids)))
	p.m.deadLetters.Add(float64(len(deadIDs)))
	p.m.errors.WithLabelValues(errKindRejected).Add(float64(len(deadIDs)))
	p.m.batchSize.Observe(float64(len(all)))
	for i := range all {
		if pe := &all[i]; pe.err == nil {
			p.m.latency.Observe(acked.Sub(pe.ev.createdAt).Seconds())
		}
	}
	if p.cfg.OnPublished != nil && len(ids) > 0 {
		published := make([]Published, 0, len(ids))
		for i := range all {
			if pe := &all[i]; pe.err == nil {
				published = append(published, Published{
					EventID: string(pe.ev.eventID), AggregateID: string(pe.ev.aggregateID), AggregateVersion: pe.ev.aggregateVersion,
					CreatedAt: pe.ev.createdAt, AckedAt: acked,
				})
			}
		}
		p.cfg.OnPublished(w.shard, published)
	}
	// A write that failed or timed out may still be on its way in kafka-go
	// (a WriteMessages call that gave up on its context leaves the request
	// running), with the batch's bytes: such a batch is not reused.
	if !retried {
		b.release()
	}
	return next, nil
}

// firstReadLimit is the read size before any shard has fitted one: events
// of up to 1 KiB fit in BatchBytes at this size, so the first reads of a
// start (64 at once) do not read rows only to leave them for the next read.
func (p *Publisher) firstReadLimit() int {
	return max(1, min(p.cfg.BatchSize, p.cfg.BatchBytes/1024))
}

// fit adapts the worker's read size to what one call can carry: a read of
// BatchSize rows whose records exceed BatchBytes sends only the first ones
// and reads the rest again with the next batch, which costs PostgreSQL the
// same rows twice. sent of read events went out with bytes in total. Shards
// started later begin with the latest limit, since one topic's events tend
// to be alike in size.
func (p *Publisher) fit(w *shardWorker, sent, read, bytes int) {
	if sent == 0 || bytes == 0 {
		return
	}
	if sent == read && read < w.readLimit {
		return // a short shard says nothing about sizes
	}
	perEvent := float64(bytes) / float64(sent)
	w.readLimit = max(1, min(p.cfg.BatchSize, int(float64(p.cfg.BatchBytes)*0.97/perEvent)))
	p.readLimit.Store(int64(w.readLimit))
}

// pickLane chooses the lane of a new shard worker: the least busy of as few
// lanes as the workers need, 64/lanes shards to a lane (8 with the default
// 8 lanes). A lane is one connection, so it prepares and plans the
// statements of the partitions of its shards only (each shard's statements
// name its partition) and keeps them. A publisher holding all 64 shards
// uses every lane; one that holds a third of them uses a third of its
// lanes, so three publishers send PostgreSQL as many queries at once as
// one, which on a small machine is faster than three times as many.
// Called with p.mu held.
func (p *Publisher) pickLane() int {
	running := 0
	for _, n := range p.laneLoad {
		running += n
	}
	perLane := (NumShards + len(p.lanes) - 1) / len(p.lanes)
	need := min(len(p.lanes), running/perLane+1)
	lane := 0
	for i := 1; i < need; i++ {
		if p.laneLoad[i] < p.laneLoad[lane] {
			lane = i
		}
	}
	return lane
}

// lane is the connection w's shard works through.
func (p *Publisher) lane(w *shardWorker) *pgxpool.Pool { return p.lanes[w.lane] }

// readTimeout bounds a read outside the recording round trip: a shard's
// lane is one connection, so a read that hangs would hold up every shard
// of the lane while heartbeats keep their leases alive.
const readTimeout = 30 * time.Second

func (p *Publisher) read(ctx context.Context, w *shardWorker) (*batch, error) {
	ctx, cancel := context.WithTimeout(ctx, readTimeout)
	defer cancel()
	rows, err := p.lane(w).Query(ctx, shardSQL[w.shard].read, w.readLimit)
	if err != nil {
		return nil, err
	}
	return scanEvents(rows, w.readLimit)
}

// scanEvents reads a batch of events with a handful of allocations: the
// variable-length columns are copied from pgx's row buffer into shared
// chunks (arena), and the columns that repeat from row to row (topic,
// types) are made into strings once.
func scanEvents(rows pgx.Rows, limit int) (*batch, error) {
	defer rows.Close()
	var b *batch
	var out []storedEvent
	var topic, aggregateType, eventType string
	// The fixed-size columns are scanned through one argument list for the
	// whole batch (a list per row would be an allocation per row); the rest
	// are read raw. Columns: id, event_id, topic, aggregate_type,
	// aggregate_id, aggregate_version, event_type, payload, headers,
	// created_at (readSQL).
	var id, version int64
	var createdAt time.Time
	dest := []any{&id, nil, nil, nil, nil, &version, nil, nil, nil, &createdAt}
	for rows.Next() {
		if b == nil {
			b = batchPool.Get().(*batch)
			out = slices.Grow(b.events[:0], limit)
		}
		if err := rows.Scan(dest...); err != nil {
			return nil, err
		}
		out = append(out, storedEvent{id: id, aggregateVersion: version, createdAt: createdAt})
		e := &out[len(out)-1]
		raw, fields := rows.RawValues(), rows.FieldDescriptions()
		buf := &b.rows
		e.eventID = buf.copy(raw[1])
		topic, aggregateType, eventType = same(topic, raw[2]), same(aggregateType, raw[3]), same(eventType, raw[6])
		e.topic, e.aggregateType, e.eventType = topic, aggregateType, eventType
		e.aggregateID = buf.copy(raw[4])
		e.payload = buf.copy(jsonText(raw[7], &fields[7]))
		e.headers = buf.copy(jsonText(raw[8], &fields[8]))
	}
	if b != nil {
		b.events = out
	}
	return b, rows.Err()
}

// same returns v as a string: prev itself when equal, without allocating.
func same(prev string, v []byte) string {
	if prev == string(v) {
		return prev
	}
	return string(v)
}

// jsonText is a json or jsonb column's value as JSON text: jsonb's binary
// format starts with a version byte (pgx asks for text, where json and
// jsonb are alike, but a connection may be set up otherwise).
func jsonText(v []byte, f *pgconn.FieldDescription) []byte {
	if f.DataTypeOID == pgtype.JSONBOID && f.Format == pgx.BinaryFormatCode && len(v) > 0 {
		return v[1:]
	}
	return v
}

// produce sends every live event of the batch and returns once each one is
// acknowledged or dead (pe.err set). Order is kept because each partition's
// share of a call is one produce request that lands whole or not at all:
// after a failure only the failed partitions' messages are sent again, in
// their original order, and a retry can duplicate but never reorder.
func (p *Publisher) produce(ctx context.Context, w *shardWorker, b *batch) (retried bool, err error) {
	pending := make([]*pendingEvent, 0, len(b.all))
	for i := range b.all {
		if pe := &b.all[i]; pe.err == nil {
			pending = append(pending, pe)
		}
	}
	var suspects []*pendingEvent // rejected as part of a partition batch
	err = p.retry(ctx, w, func(actx context.Context) error {
		b.msgs = messages(b.msgs[:0], pending)
		err := w.write(actx, b.msgs...)
		if err == nil {
			pending = nil
			return nil
		}
		retried = true
		var werrs kafka.WriteErrors
		if !errors.As(err, &werrs) || len(werrs) != len(pending) {
			if IsPermanent(err) {
				suspects, pending = append(suspects, pending...), nil
				return nil
			}
			return err
		}
		var again []*pendingEvent
		var cause error
		for i, e := range werrs {
			switch {
			case e == nil:
			case IsPermanent(e):
				suspects = append(suspects, pending[i])
			default:
				again, cause = append(again, pending[i]), e
			}
		}
		pending = again
		return cause
	})
	if err != nil {
		return retried, err
	}
	// A rejected request says nothing about which record was at fault (one
	// too-large record fails its whole partition batch): send those records
	// one at a time, in order, to find the culprits and deliver the rest.
	slices.SortFunc(suspects, func(a, b *pendingEvent) int { return int(a.ev.id - b.ev.id) })
	for _, pe := range suspects {
		retried = true
		err := p.retry(ctx, w, func(actx context.Context) error {
			err := w.write(actx, pe.msg)
			var werrs kafka.WriteErrors
			if errors.As(err, &werrs) && len(werrs) == 1 {
				err = werrs[0]
			}
			if err != nil && IsPermanent(err) {
				pe.err, pe.code = fmt.Errorf("broker rejected the record: %w", err), errorCode(err)
				return nil
			}
			return err
		})
		if err != nil {
			return retried, err
		}
	}
	return retried, nil
}

// write sends msgs in one WriteMessages call. The writer's BatchSize is set
// to the call's size first: a partition that receives the whole call then
// has a full batch and goes out at once instead of after BatchTimeout, and
// kafka-go sizes each partition batch's buffer by BatchSize, so a one-event
// call no longer allocates room for 2000 messages. Only this shard's
// goroutine calls write, and kafka-go reads BatchSize only inside
// WriteMessages, so changing it between calls is safe. A call never exceeds
// BatchSize or BatchBytes, so each partition's share is still one request.
func (w *shardWorker) write(ctx context.Context, msgs ...kafka.Message) error {
	w.writer.BatchSize = len(msgs)
	return w.writer.WriteMessages(ctx, msgs...)
}

// messages appends the messages of pes to out.
func messages(out []kafka.Message, pes []*pendingEvent) []kafka.Message {
	out = slices.Grow(out, len(pes))
	for _, pe := range pes {
		out = append(out, pe.msg)
	}
	return out
}

// retry runs op with exponential backoff and jitter until it succeeds, the
// loop's time budget runs out, the shard stops, or the lease deadline passes.
// Each attempt gets WriteTimeout; an attempt in flight is not cut short by a
// soft stop, so what the broker acknowledged gets recorded.
func (p *Publisher) retry(ctx context.Context, w *shardWorker, op func(context.Context) error) error {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = 100 * time.Millisecond
	b.MaxInterval = 5 * time.Second
	b.MaxElapsedTime = p.cfg.RetryMaxElapsed
	attempt := 0
	err := backoff.RetryNotify(func() error {
		if !p.valid(w) {
			return backoff.Permanent(errLeaseExpired)
		}
		attempt++
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.cfg.WriteTimeout)
		defer cancel()
		err := op(actx)
		if err == nil {
			p.setFailing(w, false, nil)
		}
		return err
	}, backoff.WithContext(b, ctx), func(err error, next time.Duration) {
		p.m.errors.WithLabelValues(errKindBroker).Inc()
		p.setFailing(w, true, err)
		level := slog.LevelDebug
		if attempt == 1 || attempt%10 == 0 {
			level = slog.LevelWarn // an outage fails every shard: keep the log readable
		}
		w.log.Log(ctx, level, "kafka write failed; retrying", slog.String("error", err.Error()), slog.Int("attempt", attempt), slog.Duration("next", next))
	})
	if err != nil && ctx.Err() != nil && !errors.Is(err, errLeaseExpired) {
		return ctx.Err()
	}
	return err
}

// record removes the acknowledged events from the outbox (or moves them to
// outbox_published under a retention) and parks the dead ones, fenced by the
// lease epoch, then reads the shard's next batch (unless the worker is
// stopping). All of it is one pipelined
// round trip, run by PostgreSQL as one implicit transaction that commits
// before the next batch goes to Kafka (no transaction is open while Kafka is
// waited on). It runs to completion after a soft stop: the broker already
// has the events.
func (p *Publisher) record(ctx context.Context, w *shardWorker, ids, deadIDs []int64, deadErrs []string, deadCodes []int32) (*batch, error) {
	rctx := context.WithoutCancel(ctx)
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = 100 * time.Millisecond
	b.MaxElapsedTime = p.cfg.RetryMaxElapsed
	sql := &shardSQL[w.shard]
	del := sql.delete
	if p.cfg.Retention > 0 {
		del = sql.retain
	}
	var next *batch
	// A worker told to stop (a shard given back in a rebalance, or a soft
	// stop) records its batch but does not read the next one: the rows
	// would be read only to be thrown away, and the new owner reads them
	// again.
	readNext := ctx.Err() == nil
	err := backoff.RetryNotify(func() error {
		actx, cancel := context.WithTimeout(rctx, 30*time.Second)
		defer cancel()
		batch := &pgx.Batch{}
		batch.Queue(asyncCommitSQL)
		if len(deadIDs) > 0 {
			batch.Queue(sql.deadLetter, deadIDs, w.shard, p.cfg.ID, w.epoch, deadErrs, deadCodes)
		}
		if len(ids) > 0 {
			// ids ascend: they were read in id order.
			batch.Queue(del, ids, w.shard, p.cfg.ID, w.epoch, ids[0], ids[len(ids)-1])
		}
		fenced := len(batch.QueuedQueries) - 1
		if readNext {
			batch.Queue(sql.read, w.readLimit)
		}
		err := func() error {
			br := p.lane(w).SendBatch(actx, batch)
			defer br.Close()
			if _, err := br.Exec(); err != nil {
				return err
			}
			// A lost lease makes the fenced statements no-ops; the read that
			// follows is then thrown away.
			for range fenced {
				var held bool
				var n int64
				if err := br.QueryRow().Scan(&held, &n); err != nil {
					return err
				}
				if !held {
					return ErrLeaseLost
				}
			}
			if readNext {
				rows, err := br.Query()
				if err != nil {
					return err
				}
				if next, err = scanEvents(rows, w.readLimit); err != nil {
					return err
				}
			}
			// Close reads the end of the implicit transaction: only then is
			// the recording committed.
			return br.Close()
		}()
		if errors.Is(err, ErrLeaseLost) {
			return backoff.Permanent(err)
		}
		return err
	}, backoff.WithContext(b, rctx), func(err error, next time.Duration) {
		p.m.errors.WithLabelValues(errKindDatabase).Inc()
		w.log.Warn("recording published events failed; retrying", slog.String("error", err.Error()), slog.Duration("next", next))
	})
	if err != nil {
		return nil, err
	}
	return next, nil
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
