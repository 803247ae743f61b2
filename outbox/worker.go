package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/trace"
)

// shardWorker publishes one leased shard: one batch at a time, so one key's
// events never overtake each other.
type shardWorker struct {
	p        *Publisher
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

// valid reports whether the lease is certainly still ours.
func (w *shardWorker) valid() bool { return w.p.now() < time.Duration(w.deadline.Load()) }

// leaseDeadline is the local lease deadline as a time (monotonic).
func (w *shardWorker) leaseDeadline() time.Time {
	return w.p.base.Add(time.Duration(w.deadline.Load()))
}

func (w *shardWorker) runShard(ctx context.Context) {
	p := w.p
	failures := 0
	var events *batch
	fresh := false // events were read after the last batch was recorded
	for ctx.Err() == nil {
		if !w.valid() {
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
			if events, err = w.read(ctx); err != nil {
				p.m.errors.WithLabelValues(errKindDatabase).Inc()
				err = fmt.Errorf("read shard %d: %w", w.shard, err)
			}
		}
		if err == nil && events.len() > 0 {
			// The round trip that records this batch also reads the next
			// one, so a busy shard costs one query per batch.
			events, err = w.publishBatch(ctx, events)
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
	span trace.Span // the event's producer span; nil while tracing is off
}

// publishBatch sends and records one batch read from the shard, and returns
// the shard's next batch, read in the same round trip as the recording.
func (w *shardWorker) publishBatch(ctx context.Context, b *batch) (*batch, error) {
	p := w.p
	events := b.events
	// Keep the call under BatchBytes so kafka-go sends each partition's
	// share as one request; the rest of the rows come with the next read.
	rb := &b.rb
	rb.reset(p.cfg.Source, len(events))
	all := slices.Grow(b.all[:0], len(events))
	bytes := 0
	pending := func(e *storedEvent) (pendingEvent, int) { return pendingFor(rb, e, p.cfg.BatchBytes) }
	for i := range events {
		pe, size := pending(&events[i])
		if bytes+size > p.cfg.BatchBytes {
			break
		}
		bytes += size
		all = append(all, pe)
	}
	w.fit(len(all), len(events), bytes)
	all = wholeGroups(all, events, pending)
	b.all = all
	startSendSpans(ctx, all)
	ctx, span := startPublishSpan(ctx, all)
	defer span.End()

	retried, err := w.produce(ctx, b)
	endSendSpans(all, err)
	if err != nil {
		return nil, err
	}
	acked := time.Now()

	var dead deadEvents
	for i := range all {
		if pe := &all[i]; pe.err != nil {
			dead.add(pe)
			w.log.Error("event rejected permanently; moved to outbox_dead_letters",
				slog.String("event_id", string(pe.ev.eventID)), slog.String("aggregate_id", string(pe.ev.aggregateID)), slog.String("error", pe.err.Error()))
		}
	}
	// A dead event's row goes with it: moved, or, a group's, deleted by
	// deadMembersSQL. A group's row goes once all its members are
	// acknowledged or parked (they all are: a batch holds whole groups).
	ids := make([]int64, 0, len(all)) // the rows to delete, ascending
	for i := range all {
		pe := &all[i]
		if pe.err != nil || (len(ids) > 0 && ids[len(ids)-1] == pe.ev.id) || dead.hasGroup(pe.ev.id) {
			continue
		}
		ids = append(ids, pe.ev.id)
	}
	next, err := w.record(ctx, ids, &dead)
	if err != nil {
		return nil, err
	}
	deadCount := len(dead.ids) + len(dead.memberIDs)
	p.m.published.Add(float64(len(all) - deadCount))
	p.m.deadLetters.Add(float64(deadCount))
	p.m.errors.WithLabelValues(errKindRejected).Add(float64(deadCount))
	p.m.batchSize.Observe(float64(len(all)))
	for i := range all {
		if pe := &all[i]; pe.err == nil {
			p.m.latency.Observe(acked.Sub(pe.ev.createdAt).Seconds())
		}
	}
	if p.cfg.OnPublished != nil && len(all) > deadCount {
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
	// (a produce that gave up on its context may still be encoding the
	// request until the same deadline), with the batch's bytes: such a
	// batch is not reused.
	if !retried {
		b.release()
	}
	return next, nil
}

// fit adapts the worker's read size to what one call can carry: a read of
// BatchSize rows whose records exceed BatchBytes sends only the first ones
// and reads the rest again with the next batch, which costs PostgreSQL the
// same rows twice. sent of read events went out with bytes in total. Shards
// started later begin with the latest limit, since one topic's events tend
// to be alike in size.
func (w *shardWorker) fit(sent, read, bytes int) {
	p := w.p
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

// conn is the lane (connection) the shard works through.
func (w *shardWorker) conn() *pgxpool.Pool { return w.p.lanes[w.lane] }

// readTimeout bounds a read outside the recording round trip: a shard's
// lane is one connection, so a read that hangs would hold up every shard
// of the lane while heartbeats keep their leases alive.
const readTimeout = 30 * time.Second

func (w *shardWorker) read(ctx context.Context) (*batch, error) {
	ctx, cancel := context.WithTimeout(ctx, readTimeout)
	defer cancel()
	rows, err := w.conn().Query(ctx, shardSQL[w.shard].read, w.readLimit, w.p.groupsAfterFirst())
	if err != nil {
		return nil, err
	}
	return scanEvents(rows, w.readLimit)
}

// produce sends every live event of the batch and returns once each one is
// acknowledged or dead (pe.err set). Order is kept because each partition's
// share of a call is one produce request that lands whole or not at all:
// after a failure only the failed partitions' messages are sent again, in
// their original order, and a retry can duplicate but never reorder.
func (w *shardWorker) produce(ctx context.Context, b *batch) (retried bool, err error) {
	p := w.p
	pending := make([]*pendingEvent, 0, len(b.all))
	for i := range b.all {
		if pe := &b.all[i]; pe.err == nil {
			pending = append(pending, pe)
		}
	}
	var suspects []*pendingEvent // rejected as part of a partition batch
	err = w.retry(ctx, func(actx context.Context) error {
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
			case topicUnavailable(e) && p.producer.unavailableFor(pending[i].msg.Topic) >= p.cfg.TopicWait:
				// The topic is missing or forbidden and has been for
				// TopicWait: the event is parked instead of stopping the
				// shard (the shard's other topics go on).
				pending[i].err = fmt.Errorf("topic %q unavailable for over TOPIC_WAIT=%s (create it with `publisher topics ensure`, or let the publisher write to it; then `publisher dead-letter retry`): %w",
					pending[i].msg.Topic, p.cfg.TopicWait, e)
				pending[i].code = errorCode(e)
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
	slices.SortFunc(suspects, func(a, b *pendingEvent) int {
		return cmp.Or(cmp.Compare(a.ev.id, b.ev.id), cmp.Compare(a.ev.member, b.ev.member))
	})
	for _, pe := range suspects {
		retried = true
		err := w.retry(ctx, func(actx context.Context) error {
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

// write sends msgs in one call: each partition's share is one produce
// request (see producer), so a retry can duplicate but never reorder.
func (w *shardWorker) write(ctx context.Context, msgs ...kafka.Message) error {
	return w.p.producer.write(ctx, msgs)
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
// Each attempt writes for WriteTimeout, cut to the lease deadline: bytes
// written later could deliver its records after another publisher took the
// shard and sent newer events of the same keys. The deadline is the lease's
// local one (LeaseTTL/10 before the database lets anyone else claim the
// shard); the producer writes no byte after it (cutConn). What was written
// by then gets WriteTimeout more for its answer: waiting for an answer
// sends nothing, and giving up on it would send the records again (see
// attemptDeadline). An attempt in flight is not cut short by a soft stop,
// so what the broker acknowledged gets recorded.
func (w *shardWorker) retry(ctx context.Context, op func(context.Context) error) error {
	p := w.p
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = 100 * time.Millisecond
	b.MaxInterval = 5 * time.Second
	b.MaxElapsedTime = p.cfg.RetryMaxElapsed
	attempt := 0
	err := backoff.RetryNotify(func() error {
		if !w.valid() {
			return backoff.Permanent(errLeaseExpired)
		}
		attempt++
		cut := time.Now().Add(p.cfg.WriteTimeout)
		if lease := w.leaseDeadline(); lease.Before(cut) {
			cut = lease
		}
		actx, cancel := context.WithDeadline(context.WithoutCancel(ctx), p.producer.attemptDeadline(cut))
		defer cancel()
		err := op(actx)
		if err == nil {
			w.setFailing(false, nil)
		}
		return err
	}, backoff.WithContext(b, ctx), func(err error, next time.Duration) {
		p.m.errors.WithLabelValues(errKindBroker).Inc()
		w.setFailing(true, err)
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
func (w *shardWorker) record(ctx context.Context, ids []int64, dead *deadEvents) (*batch, error) {
	p := w.p
	rctx := context.WithoutCancel(ctx)
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = 100 * time.Millisecond
	b.MaxElapsedTime = p.cfg.RetryMaxElapsed
	sql := &shardSQL[w.shard]
	// Without a retention the delete is the plain statement, whose lease
	// answer is leaseHeldSQL's; with one it is a fenced CTE like the
	// dead-letter move.
	retain := p.cfg.Retention > 0
	del := sql.delete
	if retain {
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
		// fenced counts the statements that answer (held, moved).
		fenced := 0
		if len(dead.ids) > 0 {
			batch.Queue(sql.deadLetter, dead.ids, w.shard, p.cfg.ID, w.epoch, dead.errs, dead.codes)
			fenced++
		}
		if len(dead.memberIDs) > 0 {
			// It deletes their groups' rows: the delete below finds them gone.
			batch.Queue(sql.deadMembers, dead.memberIDs, w.shard, p.cfg.ID, w.epoch, dead.memberErrs, dead.memberCodes, dead.members, retain)
			fenced++
		}
		plain := len(ids) > 0 && !retain
		if len(ids) > 0 {
			// ids ascend: they were read in id order.
			batch.Queue(del, ids, w.shard, p.cfg.ID, w.epoch, ids[0], ids[len(ids)-1])
			if plain {
				batch.Queue(leaseHeldSQL, w.shard, p.cfg.ID, w.epoch)
			} else {
				fenced++
			}
		}
		if readNext {
			batch.Queue(sql.read, w.readLimit, p.groupsAfterFirst())
		}
		err := func() error {
			br := w.conn().SendBatch(actx, batch)
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
			if plain {
				if _, err := br.Exec(); err != nil {
					return err
				}
				var held bool
				if err := br.QueryRow().Scan(&held); err != nil {
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

// setFailing tracks shards whose broker writes fail; health is degraded
// while any does.
func (w *shardWorker) setFailing(failing bool, cause error) {
	p := w.p
	if w.failing.Load() == failing {
		return
	}
	w.failing.Store(failing)
	p.failingMu.Lock()
	defer p.failingMu.Unlock()
	if failing {
		p.failing++
	} else {
		p.failing--
	}
	if p.cfg.Health == nil {
		return
	}
	switch {
	case p.failing > 0 && cause != nil:
		p.cfg.Health.SetDegraded("kafka", cause.Error())
	case p.failing == 0:
		p.cfg.Health.SetDegraded("kafka", "")
	}
}

// deadEvents are the events of a batch the broker rejected for good: rows
// of their own, moved whole to outbox_dead_letters (deadLetterSQL), and
// members of event groups, copied there one by one (deadMembersSQL).
type deadEvents struct {
	ids, memberIDs     []int64
	errs, memberErrs   []string
	codes, memberCodes []int32
	members            []int32
}

// hasGroup says whether a member of the group in row id is dead.
func (d *deadEvents) hasGroup(id int64) bool { return slices.Contains(d.memberIDs, id) }

func (d *deadEvents) add(pe *pendingEvent) {
	if pe.ev.member == 0 {
		d.ids, d.errs, d.codes = append(d.ids, pe.ev.id), append(d.errs, pe.err.Error()), append(d.codes, pe.code)
		return
	}
	d.memberIDs, d.memberErrs, d.memberCodes = append(d.memberIDs, pe.ev.id), append(d.memberErrs, pe.err.Error()), append(d.memberCodes, pe.code)
	d.members = append(d.members, pe.ev.member)
}

// wholeGroups cuts all, the first events of a batch that fit in one call,
// back to the end of the last whole event group: a group's row is deleted
// once for all its members, so a batch never ends inside one. The rest of
// the group comes with the next read. When the first group alone does not
// fit, it is taken whole (pending makes the records, a member too large for
// any call dead at once): one call larger than BatchBytes, whose
// partitions' requests the broker may refuse as too large, which sends
// them one record at a time (produce's suspects), in order.
func wholeGroups(all []pendingEvent, events []storedEvent, pending func(*storedEvent) (pendingEvent, int)) []pendingEvent {
	n := len(all)
	if n == 0 || n == len(events) || events[n].member <= 1 {
		return all
	}
	start := n - 1
	for events[start].member > 1 {
		start--
	}
	if start > 0 {
		return all[:start]
	}
	for ; n < len(events) && events[n].member > 1; n++ {
		pe, _ := pending(&events[n])
		all = append(all, pe)
	}
	return all
}

// pendingFor makes e's record. An event whose record alone is larger than
// a call may carry (batchBytes) is dead at once; size is 0 for a dead one.
func pendingFor(rb *recordBuilder, e *storedEvent, batchBytes int) (pe pendingEvent, size int) {
	pe = pendingEvent{ev: e}
	if pe.msg, pe.err = rb.record(e); pe.err != nil {
		return pe, 0
	}
	if size = messageSize(&pe.msg); size > batchBytes {
		pe.err = fmt.Errorf("%w: %d bytes, limit %d (BATCH_BYTES; broker message.max.bytes): %w", ErrMessageTooLarge, size, batchBytes, kafka.MessageSizeTooLarge)
		pe.code = int32(kafka.MessageSizeTooLarge)
		return pe, 0
	}
	return pe, size
}

// groupsAfterFirst is readSQL's $2: how many event groups a read takes
// after its first one. A call carries BatchBytes, a group about GroupBytes
// at most and usually half as much (a chunk's events for one shard), so
// the groups of one read fill about one call; the rest of a read that does
// not fit is read again with the next batch.
func (p *Publisher) groupsAfterFirst() int {
	return max(1, p.cfg.BatchBytes/(GroupBytes/2)) - 1
}
