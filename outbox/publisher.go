package outbox

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/compress"
)

var (
	// ErrLeaseLost is returned inside the publisher when a shard's fenced
	// write found another owner or epoch: the shard worker stops at once.
	ErrLeaseLost = errors.New("shard lease lost")
	// ErrPublisherIDInUse is returned by [Publisher.Run] when another running
	// process uses the same Config.ID (PUBLISHER_ID): two processes under one
	// id would renew the same leases and send the same shards at once. The
	// process that held the id first keeps it and its shards.
	ErrPublisherIDInUse = errors.New("publisher id in use by another running publisher")
)

// Publisher drains outbox_events to Kafka. Run several, in one process or
// many; they share the 64 shards through leases. See the package doc.
type Publisher struct {
	cfg       Config
	instance  string // this process's token in outbox_publishers (see ErrPublisherIDInUse)
	pool      *pgxpool.Pool
	leasePool *pgxpool.Pool   // heartbeats: never wait behind shard work
	lanes     []*pgxpool.Pool // one connection each; a worker keeps the lane it started on (pickLane)
	log       *slog.Logger
	m         *publisherMetrics
	transport *kafka.Transport
	producer  *producer
	base      time.Time // monotonic origin of lease deadlines

	mu        sync.Mutex
	laneLoad  []int // running shard workers per lane
	workers   map[int]*shardWorker
	releasing map[int]bool
	// retired are workers of shards whose lease was lost or replaced, told
	// to stop and not finished yet: the shard gets no new worker before its
	// old one is done, so two of this publisher's workers never send from
	// one shard at once.
	retired map[int]*shardWorker
	wg      sync.WaitGroup

	notify       chan struct{} // run the pending-shards query now
	rebalanceNow chan struct{} // membership changed: rebalance before the next heartbeat
	announceCh   chan struct{} // a shard was given back: tell the others (announcer)
	joined       bool          // the first heartbeat announced this publisher

	readLimit atomic.Int64 // the last read size a shard fitted to BatchBytes (shardWorker.readLimit)

	failingMu sync.Mutex
	failing   int // shard workers whose last produce failed
}

// NewPublisher checks cfg and returns a publisher on pool. Run opens, from
// pool's configuration, Config.ShardConns connections for the shard work
// (lanes, each opened when a shard first needs it: a publisher holding a
// third of the shards opens about a third of them), two for heartbeats
// and, unless Config.NoListen, one to LISTEN; pool itself serves the
// occasional queries (start checks, polling, backlog, cleanup of retained
// rows), which never need more than one connection at a time. So a
// publisher holds at most ShardConns + 3 connections besides pool's, and
// `publisher run` opens pool with one: DATABASE_MAX_CONNS + 4 in all.
func NewPublisher(pool *pgxpool.Pool, cfg Config) (*Publisher, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	// Attempts wait WriteTimeout for answers after their cut: the producer's
	// deadlines and its connections' split agree on it (attemptDeadline).
	ackWait := cfg.WriteTimeout
	p := &Publisher{
		cfg:          cfg,
		instance:     newInstanceToken(),
		pool:         pool,
		log:          cfg.Logger.With(slog.String("publisher", cfg.ID)),
		m:            newPublisherMetrics(cfg.Registerer),
		base:         time.Now(),
		workers:      map[int]*shardWorker{},
		releasing:    map[int]bool{},
		retired:      map[int]*shardWorker{},
		notify:       make(chan struct{}, 1),
		rebalanceNow: make(chan struct{}, 1),
		announceCh:   make(chan struct{}, 1),
		transport: &kafka.Transport{
			Dial:        cutDial(cfg.Dial, ackWait),
			DialTimeout: 5 * time.Second,
			IdleTimeout: 30 * time.Second,
			MetadataTTL: 10 * time.Second,
			ClientID:    "outboxrelay-publisher",
			TLS:         cfg.TLS,
			SASL:        cfg.SASL,
		},
	}
	var codec compress.Compression
	_ = codec.UnmarshalText([]byte(cfg.Compression)) // validate checked it
	p.producer = newProducer(p.transport, cfg.Brokers, cfg.Topics, codec, ackWait)
	return p, nil
}

// ID is the publisher's name in outbox_publishers and the lease table.
func (p *Publisher) ID() string { return p.cfg.ID }

// Run publishes until ctx is cancelled, then stops softly: each shard
// finishes the batch it is sending and records it, the leases are released
// so other publishers take over at once, and Run returns nil. It returns an
// error only when it cannot start, or when its id is another running
// publisher's ([ErrPublisherIDInUse]).
func (p *Publisher) Run(ctx context.Context) error {
	if err := p.pool.Ping(ctx); err != nil {
		return fmt.Errorf("publisher %s: database: %w", p.cfg.ID, err)
	}
	if err := checkIDSequence(ctx, p.pool); err != nil {
		return fmt.Errorf("publisher %s: %w", p.cfg.ID, err)
	}
	lcfg := p.pool.Config().Copy()
	lcfg.MaxConns, lcfg.MinConns = 2, 0
	leasePool, err := pgxpool.NewWithConfig(ctx, lcfg)
	if err != nil {
		return fmt.Errorf("publisher %s: lease connection: %w", p.cfg.ID, err)
	}
	p.leasePool = leasePool
	defer leasePool.Close()
	// Shard work goes through lanes of one connection each (see lane).
	p.lanes = make([]*pgxpool.Pool, max(1, cmp.Or(p.cfg.ShardConns, int(p.pool.Config().MaxConns))))
	p.laneLoad = make([]int, len(p.lanes))
	for i := range p.lanes {
		cfg := p.pool.Config().Copy()
		cfg.MaxConns, cfg.MinConns = 1, 0 // connected when first used
		if p.lanes[i], err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
			return fmt.Errorf("publisher %s: shard connection: %w", p.cfg.ID, err)
		}
		defer p.lanes[i].Close()
	}
	notify, err := notifyEnabled(ctx, p.pool)
	if err != nil {
		return fmt.Errorf("publisher %s: %w", p.cfg.ID, err)
	}
	wakeup := "NOTIFY, polling every " + p.cfg.PollInterval.String() + " as a fallback"
	switch {
	case p.cfg.NoListen:
		wakeup = "polling every " + p.cfg.PollInterval.String() + " (LISTEN off)"
	case !notify:
		wakeup = "polling every " + p.cfg.PollInterval.String() + " (the outbox NOTIFY trigger is off: see `publisher notify`)"
	}
	p.log.Info("publisher starting", slog.Int("batch_size", p.cfg.BatchSize), slog.Duration("lease_ttl", p.cfg.LeaseTTL),
		slog.Int("shard_conns", len(p.lanes)), slog.String("wakeup", wakeup))
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var bg sync.WaitGroup
	background := []func(context.Context){p.dispatch, p.watchBacklog, p.cleanupPublished, p.announcer}
	if !p.cfg.NoListen {
		background = append(background, p.listen)
	}
	for _, fn := range background {
		bg.Add(1)
		go func() {
			defer bg.Done()
			fn(ctx)
		}()
	}

	beat := time.NewTicker(p.cfg.LeaseTTL / 3)
	defer beat.Stop()
	// A process that restarts under its id finds its previous membership
	// still live for up to LeaseTTL: only an id that is renewed by someone
	// else for longer than that is another running publisher's.
	joinBy := time.Now().Add(p.cfg.LeaseTTL + p.cfg.LeaseTTL/3)
	for {
		err := p.rebalance(ctx)
		var inUse *idInUseError
		switch {
		case errors.As(err, &inUse) && (p.joined || time.Now().After(joinBy)):
			p.log.Error("publisher id in use by another running publisher; stopping", slog.String("other_instance", inUse.other))
			p.stop()
			cancel()
			bg.Wait()
			p.transport.CloseIdleConnections()
			return err
		case err != nil && ctx.Err() == nil && inUse == nil:
			p.m.errors.WithLabelValues(errKindDatabase).Inc()
			p.log.Warn("heartbeat failed; shards stop when their lease runs out", slog.String("error", err.Error()))
		}
		select {
		case <-ctx.Done():
			p.stop()
			bg.Wait()
			p.transport.CloseIdleConnections()
			return nil
		case <-beat.C:
		case <-p.rebalanceNow:
		}
	}
}

// stop ends every shard worker, then releases leases and membership and
// announces it, so the remaining publishers rebalance at once.
func (p *Publisher) stop() {
	p.mu.Lock()
	workers := make([]*shardWorker, 0, len(p.workers))
	for _, w := range p.workers {
		workers = append(workers, w)
	}
	p.mu.Unlock()
	for _, w := range workers {
		w.cancel()
	}
	p.wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, w := range workers {
		if _, err := p.leasePool.Exec(ctx, releaseLeaseSQL, w.shard, p.cfg.ID, w.epoch, p.instance); err != nil {
			p.log.Warn("release lease", slog.Int("shard", w.shard), slog.String("error", err.Error()))
		}
	}
	if _, err := p.leasePool.Exec(ctx, leaveSQL, p.cfg.ID, p.instance); err != nil {
		p.log.Warn("leave", slog.String("error", err.Error()))
	}
	p.announce(ctx)
	p.m.shards.Set(0)
	p.log.Info("publisher stopped", slog.Int("shards_released", len(workers)))
}

// ErrIDSequenceCached is returned by [Publisher.Run] when outbox_events'
// identity sequence hands out ids in cached blocks (CACHE > 1).
var ErrIDSequenceCached = errors.New("outbox_events id sequence has CACHE > 1")

// checkIDSequence refuses an id sequence with CACHE > 1. Per-key order
// rests on a writer that commits after another writer of the same aggregate
// getting the higher id (see Enqueue); with a cache every session draws ids
// from a block of its own, so the later transaction can get the lower id
// and its event would be published first.
func checkIDSequence(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) error {
	var cache int64
	if err := q.QueryRow(ctx, idCacheSQL).Scan(&cache); err != nil {
		return fmt.Errorf("read the outbox_events id sequence: %w", err)
	}
	if cache > 1 {
		return fmt.Errorf("%w: it is CACHE %d, so sessions take ids from blocks of their own and a later commit of one aggregate can get a lower id, which breaks per-key order; run ALTER SEQUENCE outbox_events_id_seq CACHE 1 (migration 005 creates it so)",
			ErrIDSequenceCached, cache)
	}
	return nil
}

// idInUseError is ErrPublisherIDInUse with the instance that holds the id.
type idInUseError struct {
	id, other string
	left      time.Duration // until the other instance's membership expires
}

func (e *idInUseError) Error() string {
	return fmt.Sprintf("PUBLISHER_ID=%q is used by another running publisher (instance %q, membership valid for %s more): give each publisher its own PUBLISHER_ID, or leave it unset for a generated one",
		e.id, e.other, e.left.Round(time.Millisecond))
}

func (e *idInUseError) Unwrap() error { return ErrPublisherIDInUse }

// newInstanceToken is a random token naming this process in
// outbox_publishers.
func newInstanceToken() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

type lease struct {
	shard int
	epoch int64
}

// rebalance is one heartbeat: renew membership and leases, then claim or
// release shards so each live publisher holds about ceil(64/live). It also
// runs at once when another publisher joins, gives shards back or leaves
// (membersChannel), so a publisher that starts next to a running one gets
// its share within one batch time instead of one or two heartbeats.
func (p *Publisher) rebalance(ctx context.Context) error {
	start := p.now()
	hb, err := p.heartbeat(ctx)
	if err != nil {
		return err
	}
	p.joined = true
	// The database extended the leases to now()+TTL at some point after
	// start; counting from start keeps the local deadline on the safe side.
	deadline := start + p.cfg.LeaseTTL - p.cfg.LeaseTTL/10

	p.mu.Lock()
	defer p.mu.Unlock()
	p.runHeld(ctx, hb, deadline)
	p.giveBack(hb.target)
	p.m.shards.Set(float64(len(p.workers)))
	return nil
}

// heartbeatResult is what one heartbeat transaction found.
type heartbeatResult struct {
	target           int // shards each live publisher should hold
	renewed, claimed []lease
	// giving is the renewed shards that were being given back when counted.
	// Their release waits for the heartbeat's row locks and may be done
	// (p.releasing cleared) by the time the workers are started: such a
	// shard's renewal is stale, and starting a worker on it would send from
	// a shard another publisher is free to claim.
	giving map[int]bool
}

// heartbeat renews membership and leases and claims free shards up to this
// publisher's share, in one transaction.
func (p *Publisher) heartbeat(ctx context.Context) (heartbeatResult, error) {
	hb := heartbeatResult{giving: map[int]bool{}}
	err := pgx.BeginFunc(ctx, p.leasePool, func(tx pgx.Tx) error {
		var live int
		var mine bool
		if err := tx.QueryRow(ctx, heartbeatSQL, p.cfg.ID, p.cfg.LeaseTTL, p.instance).Scan(&mine, &live); err != nil {
			return fmt.Errorf("heartbeat: %w", err)
		}
		if !mine {
			e := &idInUseError{id: p.cfg.ID}
			if err := tx.QueryRow(ctx, publisherInstanceSQL, p.cfg.ID).Scan(&e.other, &e.left); err != nil {
				return fmt.Errorf("heartbeat: look up the instance holding id %q: %w", p.cfg.ID, err)
			}
			return e
		}
		var err error
		if hb.renewed, err = scanLeases(tx.Query(ctx, renewLeasesSQL, p.cfg.ID, p.cfg.LeaseTTL)); err != nil {
			return fmt.Errorf("renew leases: %w", err)
		}
		hb.target = int(math.Ceil(float64(NumShards) / float64(max(live, 1))))
		p.mu.Lock()
		owned := 0
		for _, l := range hb.renewed {
			if p.releasing[l.shard] {
				hb.giving[l.shard] = true
			} else {
				owned++
			}
		}
		p.mu.Unlock()
		if owned < hb.target {
			if hb.claimed, err = scanLeases(tx.Query(ctx, claimLeasesSQL, p.cfg.ID, p.cfg.LeaseTTL, hb.target-owned)); err != nil {
				return fmt.Errorf("claim leases: %w", err)
			}
		}
		if _, err := tx.Exec(ctx, forgetDeadPublishersSQL, 10*p.cfg.LeaseTTL); err != nil {
			return fmt.Errorf("forget dead publishers: %w", err)
		}
		if !p.joined {
			// Delivered at commit: the others give back their surplus now.
			if _, err := tx.Exec(ctx, membersChangedSQL, p.cfg.ID); err != nil {
				return fmt.Errorf("announce: %w", err)
			}
		}
		return nil
	})
	return hb, err
}

// runHeld makes the workers match the leases the heartbeat holds: a worker
// per held shard, running until deadline unless renewed again; workers of
// shards no longer held are stopped. Called with p.mu held.
func (p *Publisher) runHeld(ctx context.Context, hb heartbeatResult, deadline time.Duration) {
	held := map[int]bool{}
	for _, l := range append(hb.renewed, hb.claimed...) {
		held[l.shard] = true
		if p.releasing[l.shard] || hb.giving[l.shard] {
			continue
		}
		w := p.workers[l.shard]
		if w != nil && (w.epoch != l.epoch || w.exited()) {
			p.retire(w)
			w = nil
		}
		if w == nil {
			if p.retired[l.shard] != nil {
				continue // started once the old worker is done (retire)
			}
			w = p.startWorker(ctx, l, deadline)
			p.log.Debug("shard acquired", slog.Int("shard", l.shard), slog.Int64("epoch", l.epoch))
		}
		w.deadline.Store(int64(deadline))
	}
	for shard, w := range p.workers {
		if !held[shard] {
			p.log.Warn("shard lease lost", slog.Int("shard", shard), slog.Int64("epoch", w.epoch))
			p.retire(w)
		}
	}
}

// retire stops w, whose lease is lost or replaced, and keeps the shard from
// getting a new worker until w is done; then it asks for a rebalance, which
// starts the new worker if the shard is still held. Called with p.mu held.
func (p *Publisher) retire(w *shardWorker) {
	w.cancel()
	delete(p.workers, w.shard)
	if w.exited() {
		return
	}
	p.retired[w.shard] = w
	go func() {
		<-w.done
		p.mu.Lock()
		if p.retired[w.shard] == w {
			delete(p.retired, w.shard)
		}
		p.mu.Unlock()
		select {
		case p.rebalanceNow <- struct{}{}:
		default:
		}
	}()
}

// giveBack gives surplus shards back, highest first, once their worker has
// finished its batch; the lease is renewed meanwhile so nobody else sends
// from the shard before this publisher has stopped. Each shard given back
// is announced, so the others claim it at once rather than when the
// slowest of the batches in flight is done. Called with p.mu held.
func (p *Publisher) giveBack(target int) {
	for shard := NumShards - 1; shard >= 0 && len(p.workers) > target; shard-- {
		w := p.workers[shard]
		if w == nil {
			continue
		}
		delete(p.workers, shard)
		p.releasing[shard] = true
		w.cancel()
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			<-w.done
			rctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if _, err := p.leasePool.Exec(rctx, releaseLeaseSQL, w.shard, p.cfg.ID, w.epoch, p.instance); err != nil {
				p.log.Warn("release lease", slog.Int("shard", w.shard), slog.String("error", err.Error()))
			} else {
				p.log.Debug("shard released for rebalance", slog.Int("shard", w.shard), slog.Int("target", target))
				p.announceSoon()
			}
			p.mu.Lock()
			delete(p.releasing, w.shard)
			p.mu.Unlock()
		}()
	}
}

func scanLeases(rows pgx.Rows, err error) ([]lease, error) {
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (lease, error) {
		var l lease
		var shard int16
		err := r.Scan(&shard, &l.epoch)
		l.shard = int(shard)
		return l, err
	})
}

// announceSoon asks the announcer to announce: shards given back one after
// another within a moment make one announcement, or a few, instead of one
// rebalance per shard in every other publisher.
func (p *Publisher) announceSoon() {
	select {
	case p.announceCh <- struct{}{}:
	default: // one is pending already and will cover this one
	}
}

// announcer announces what announceSoon asked for, one at a time.
func (p *Publisher) announcer(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.announceCh:
		}
		actx, cancel := context.WithTimeout(ctx, 10*time.Second)
		p.announce(actx)
		cancel()
	}
}

// announce tells the other publishers that membership or the free shards
// changed, so they rebalance now. Best effort: heartbeats catch up anyway.
func (p *Publisher) announce(ctx context.Context) {
	if _, err := p.leasePool.Exec(ctx, membersChangedSQL, p.cfg.ID); err != nil && ctx.Err() == nil {
		p.log.Debug("announce membership change", slog.String("error", err.Error()))
	}
}

// now is a monotonic clock for lease deadlines (immune to wall-clock jumps).
func (p *Publisher) now() time.Duration { return time.Since(p.base) }

// listen wakes shard workers on every NOTIFY from the outbox trigger, and
// rebalances when another publisher announces a change, on a connection of
// its own (a pooled one could not wait). When the connection fails, polling
// and heartbeats carry on and listen reconnects.
func (p *Publisher) listen(ctx context.Context) {
	for ctx.Err() == nil {
		err := p.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		p.log.Warn("LISTEN connection lost; polling until it is back", slog.String("error", err.Error()))
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

func (p *Publisher) listenOnce(ctx context.Context) error {
	conn, err := pgx.ConnectConfig(ctx, p.pool.Config().ConnConfig.Copy())
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+notifyChannel+"; LISTEN "+membersChannel); err != nil {
		return err
	}
	p.poke() // events may have committed while we were not listening
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		switch {
		case n.Channel == membersChannel:
			if n.Payload != p.cfg.ID {
				select {
				case p.rebalanceNow <- struct{}{}:
				default:
				}
			}
		case !p.wakeShards(n.Payload):
			p.poke()
		}
	}
}

// wakeShards wakes the workers of the shards a notification names ("3,17").
// The trigger computed them from the inserted rows, so no query is needed;
// a shard held by another publisher is that publisher's to wake. It reports
// false for a payload it cannot read, and the dispatcher asks the database.
func (p *Publisher) wakeShards(payload string) bool {
	if payload == "" {
		return false
	}
	var shards [NumShards]bool
	for field := range strings.SplitSeq(payload, ",") {
		s, err := strconv.Atoi(field)
		if err != nil || s < 0 || s >= NumShards {
			return false
		}
		shards[s] = true
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for s, touched := range shards {
		if w := p.workers[s]; touched && w != nil {
			w.wakeUp()
		}
	}
	return true
}

func (p *Publisher) poke() {
	select {
	case p.notify <- struct{}{}:
	default:
	}
}

// dispatch is the fallback for notifications that name no shards and for
// lost ones: on a poke or every PollInterval it asks which of this
// publisher's shards hold events and wakes those workers, one cheap query
// however many pokes arrived meanwhile.
func (p *Publisher) dispatch(ctx context.Context) {
	tick := time.NewTicker(p.cfg.PollInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.notify:
		case <-tick.C:
		}
		// Busy workers read again on their own; only idle ones can be
		// waiting for a notification that was lost.
		var idle []int16
		p.mu.Lock()
		for s, w := range p.workers {
			if w.idle.Load() {
				idle = append(idle, int16(s))
			}
		}
		p.mu.Unlock()
		if len(idle) == 0 {
			continue
		}
		rows, err := p.pool.Query(ctx, pendingShardsSQL, idle)
		if err != nil {
			if ctx.Err() == nil {
				p.log.Debug("look for pending shards", slog.String("error", err.Error()))
			}
			continue
		}
		shards, err := pgx.CollectRows(rows, pgx.RowTo[int16])
		if err != nil {
			continue
		}
		p.mu.Lock()
		for _, s := range shards {
			if w := p.workers[int(s)]; w != nil {
				w.wakeUp()
			}
		}
		p.mu.Unlock()
	}
}

// watchBacklog refreshes the backlog gauges.
func (p *Publisher) watchBacklog(ctx context.Context) {
	tick := time.NewTicker(p.cfg.BacklogInterval)
	defer tick.Stop()
	for {
		var n int64
		var age float64
		if err := p.pool.QueryRow(ctx, backlogSQL).Scan(&n, &age); err == nil {
			p.m.backlog.Set(float64(n))
			p.m.oldestAge.Set(age)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// cleanupPublished deletes retained rows past the retention, in batches.
func (p *Publisher) cleanupPublished(ctx context.Context) {
	if p.cfg.Retention <= 0 {
		return
	}
	every := min(max(p.cfg.Retention/10, time.Second), time.Minute)
	tick := time.NewTicker(every)
	defer tick.Stop()
	const batch = 5000
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		for ctx.Err() == nil {
			tag, err := p.pool.Exec(ctx, cleanupPublishedSQL, p.cfg.Retention, batch)
			if err != nil {
				p.log.Warn("delete retained events", slog.String("error", err.Error()))
				break
			}
			if tag.RowsAffected() < batch {
				break
			}
		}
	}
}

// startWorker runs a worker for a freshly held lease. Called with p.mu held.
func (p *Publisher) startWorker(parent context.Context, l lease, deadline time.Duration) *shardWorker {
	ctx, cancel := context.WithCancel(parent)
	w := &shardWorker{
		p:      p,
		shard:  l.shard,
		epoch:  l.epoch,
		cancel: cancel,
		done:   make(chan struct{}),
		wake:   make(chan struct{}, 1),

		readLimit: cmp.Or(int(p.readLimit.Load()), p.firstReadLimit()),
		lane:      p.pickLane(),
		log:       p.log.With(slog.Int("shard", l.shard), slog.Int64("epoch", l.epoch)),
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
		defer w.setFailing(false, nil)
		w.runShard(ctx)
	}()
	return w
}

// firstReadLimit is the read size before any shard has fitted one: events
// of up to 1 KiB fit in BatchBytes at this size, so the first reads of a
// start (64 at once) do not read rows only to leave them for the next read.
func (p *Publisher) firstReadLimit() int {
	return max(1, min(p.cfg.BatchSize, p.cfg.BatchBytes/1024))
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
