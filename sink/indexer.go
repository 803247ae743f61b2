package sink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/olivere/elastic/v7"
	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"
	"golang.org/x/sync/errgroup"

	"github.com/outboxrelay/outboxrelay/index"
)

// Sentinel errors.
var (
	// ErrRetriesExhausted: the engine kept refusing a batch for longer than
	// RetryMaxElapsed. Nothing of the batch was committed.
	ErrRetriesExhausted = errors.New("search engine retries exhausted")
)

// Failpoints crash tests can arm (internal/failpoint).
const (
	FailpointAfterBulk   = "sink.after-bulk"   // batch indexed, offsets not committed
	FailpointAfterCommit = "sink.after-commit" // offsets committed
)

// Indexer consumes the topic in a consumer group and writes every message
// into the search index through the write alias. Build it with [New] and
// call [Indexer.Run].
type Indexer struct {
	cfg      Config
	log      *slog.Logger
	client   *elastic.Client
	rules    *recordRules
	dlq      *deadLetterWriter
	throttle *throttle
	router   *router
	pvGate   *pvGate
	m        *metrics
	// onBatch, if set, is called after every resolved and committed batch
	// (tests).
	onBatch func(Batch)

	genRefresh time.Duration // watchGenerations' interval; 0: generationRefresh (tests shorten it)
	// closeReader closes a generation's partition reader; nil: Close
	// (tests slow it down).
	closeReader func(*kgo.Client)

	clientIdentity // GroupReady (ready.go)
}

// Batch describes one resolved batch, for [Config] observers and tests.
type Batch struct {
	Lane                                              int
	Docs, Indexed, Conflicts, Dead, Skipped, Attempts int
}

// New validates cfg and builds an Indexer. It does not touch the network.
func New(cfg Config) (*Indexer, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, &ConfigError{Err: err}
	}
	client, err := index.NewClientWith(cfg.URL, cfg.HTTPClient)
	if err != nil {
		return nil, &ConfigError{Err: err}
	}
	m := newMetrics(cfg.Registerer)
	rules := newRecordRules(cfg)
	return &Indexer{
		cfg:      cfg,
		log:      cfg.Logger,
		client:   client,
		rules:    rules,
		dlq:      newDeadLetterWriter(cfg),
		throttle: newThrottle(cfg.MaxRate, cfg.BatchSize, m.rateLimit.Set),
		router:   newRouter(client, cfg, rules),
		pvGate:   newPVGate(client, cfg),
		m:        m,
	}, nil
}

// ConfigError is a bad setting (exit code 2 in the command).
type ConfigError struct{ Err error }

func (e *ConfigError) Error() string { return e.Err.Error() }
func (e *ConfigError) Unwrap() error { return e.Err }

// Client returns the search engine client.
func (ix *Indexer) Client() *elastic.Client { return ix.client }

// Ping checks that the engine answers (readiness).
func (ix *Indexer) Ping(ctx context.Context) error { return ping(ctx, ix.client) }

// Run consumes until ctx ends or a batch fails for good. It creates the
// index and its aliases when missing and the dead-letter topic when
// missing. When ctx ends, the batch in flight is abandoned uncommitted (its
// messages are replayed harmlessly by whoever owns the partition next).
func (ix *Indexer) Run(ctx context.Context) error {
	// The engine or the broker may still be starting (or restarting) when
	// the indexer does: wait for them within the retry budget instead of
	// exiting at once; a refusal that will not heal (a bad mapping) stops.
	var idx string
	err := backoff.RetryNotify(func() error {
		var err error
		if idx, err = ix.ensureIndexes(ctx); err != nil {
			if !index.IsRetryable(err) || errors.Is(err, index.ErrWriteAliasMissing) {
				return backoff.Permanent(err)
			}
			return err
		}
		return ix.ensureDeadLetterTopic(ctx)
	}, ix.newBackOff(ctx), func(err error, next time.Duration) {
		ix.log.Warn("indexer not ready: search engine or broker unavailable; retrying",
			slog.String("error", err.Error()), slog.Duration("next", next))
	})
	if err != nil {
		return err
	}
	if err := ix.awaitTopic(ctx); err != nil {
		if ctx.Err() != nil {
			return nil // stopped while waiting
		}
		return err
	}
	ix.log.Info("indexer starting",
		slog.String("topic", ix.cfg.Topic), slog.String("group", ix.cfg.Group),
		slog.String("write_alias", ix.cfg.WriteAlias), slog.String("index", idx),
		slog.Int("lanes", ix.cfg.Lanes), slog.Int("batch_size", ix.cfg.BatchSize))

	group, err := kafka.NewConsumerGroup(kafka.ConsumerGroupConfig{
		ID:                ix.cfg.Group,
		Brokers:           ix.cfg.Brokers,
		Topics:            []string{ix.cfg.Topic},
		Dialer:            ix.cfg.kafkaDialer(ix.clientID()),
		StartOffset:       kafka.FirstOffset,
		SessionTimeout:    ix.cfg.SessionTimeout,
		HeartbeatInterval: ix.cfg.HeartbeatInterval,
		RebalanceTimeout:  ix.cfg.SessionTimeout,
		JoinGroupBackoff:  time.Second,
		// Partitions added later trigger a rebalance instead of staying
		// unread.
		WatchPartitionChanges:  true,
		PartitionWatchInterval: 2 * time.Second,
		ErrorLogger:            ix.kafkaLogger("kafka consumer group"),
	})
	if err != nil {
		return &ConfigError{Err: fmt.Errorf("consumer group %s: %w", ix.cfg.Group, err)}
	}
	// Closed last: the committer commits what the lanes resolved under the
	// generation that is still current, then the member leaves the group.
	defer group.Close()
	defer ix.dlq.Close()

	bl := newBacklog(ix.cfg)
	resolved := make(chan resolvedBatch, ix.cfg.Lanes)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return ix.consume(gctx, group, bl) })
	for lane := range ix.cfg.Lanes {
		g.Go(func() error { return ix.runLane(gctx, bl, lane, resolved) })
	}
	g.Go(func() error { ix.watchDeadLetters(gctx); return nil })
	g.Go(func() error { ix.watchGenerations(gctx); return nil })
	// The committer outlives the lanes: whatever they resolved before
	// stopping is still committed.
	committerDone := make(chan struct{})
	go func() {
		defer close(committerDone)
		ix.runCommitter(gctx, resolved)
	}()
	err = g.Wait()
	close(resolved)
	<-committerDone
	if err == nil && ctx.Err() != nil {
		ix.log.Info("indexer stopped")
	}
	return err
}

func (ix *Indexer) kafkaLogger(what string) kafka.Logger {
	return kafka.LoggerFunc(func(msg string, args ...any) {
		ix.log.Warn(what, slog.String("error", fmt.Sprintf(msg, args...)))
	})
}

// groupMember is the part of [kafka.ConsumerGroup] consume uses.
type groupMember interface {
	Next(ctx context.Context) (*kafka.Generation, error)
}

// consume joins one group generation after the other and reads its
// partitions into the backlog, until ctx ends.
func (ix *Indexer) consume(ctx context.Context, group groupMember, bl *backlog) error {
	var failingSince time.Time // set while joins fail
	for {
		gen, err := group.Next(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, kafka.ErrGroupClosed) {
				return fmt.Errorf("join group %s on %s: %w", ix.cfg.Group, ix.cfg.Topic, err)
			}
			// The group reports a generation it could not join (a
			// rebalance in progress, a member id the coordinator dropped
			// while this process was stalled) and tries again on its own
			// once asked: after most errors it first waits
			// JoinGroupBackoff, but after RebalanceInProgress it keeps its
			// member id and must rejoin before the rebalance times out.
			// So ask again at once; waiting here would have the member
			// expelled, rejoin as a new one and start the next rebalance.
			if failingSince.IsZero() {
				failingSince = time.Now()
			}
			if time.Since(failingSince) >= ix.cfg.RetryMaxElapsed {
				return fmt.Errorf("join group %s on %s: %w", ix.cfg.Group, ix.cfg.Topic, err)
			}
			ix.log.Warn("joining the group failed; retrying", slog.String("error", err.Error()))
			continue
		}
		failingSince = time.Time{}
		ix.consumeGeneration(ctx, gen, bl)
		if ctx.Err() != nil {
			return nil
		}
	}
}

// generation is one consumer group generation as the committer sees it:
// offsets are committed under the generation that fetched them,
// so the coordinator refuses them once the group has moved on.
type generation struct {
	id      int32
	commits chan commitRequest
	ended   chan struct{} // closed when the generation is over
}

type commitRequest struct {
	offsets map[string]map[int]int64
	done    chan error
}

// errGenerationEnded: the batch was fetched in a generation that is over;
// its partitions' current owners replay it.
var errGenerationEnded = errors.New("consumer group generation ended")

// commit commits offsets (next offset to read, per partition) under g.
func (g *generation) commit(ctx context.Context, topic string, offsets map[int]int64) error {
	req := commitRequest{offsets: map[string]map[int]int64{topic: offsets}, done: make(chan error, 1)}
	select {
	case g.commits <- req:
	case <-g.ended:
		return errGenerationEnded
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-req.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// consumeGeneration runs a fetcher for the assigned partitions and a
// commit loop, both bound to gen: kafka-go joins the next generation only
// after they have returned, so no commit of this generation can reach the
// coordinator once a newer one exists. When the generation ends, its
// messages still in the backlog are dropped (batches already taken finish
// and are not committed): the partitions' owners in the next generation
// read them again from the committed offsets.
func (ix *Indexer) consumeGeneration(ctx context.Context, gen *kafka.Generation, bl *backlog) {
	g := &generation{id: gen.ID, commits: make(chan commitRequest), ended: make(chan struct{})}
	gen.Start(func(gctx context.Context) {
		defer close(g.ended)
		for {
			select {
			case req := <-g.commits:
				req.done <- gen.CommitOffsets(req.offsets)
			case <-gctx.Done():
				return
			}
		}
	})
	assigned := gen.Assignments[ix.cfg.Topic]
	parts := make([]int, len(assigned))
	for i, pa := range assigned {
		parts[i] = pa.ID
	}
	fetched := make(chan struct{})
	gen.Start(func(gctx context.Context) {
		defer close(fetched)
		ix.fetch(gctx, g, assigned, bl)
	})
	ix.log.Info("group generation joined", slog.Int("generation", int(gen.ID)), slog.String("member", gen.MemberID), slog.Any("partitions", parts))
	select {
	case <-g.ended:
	case <-ctx.Done():
		return // the group is closed after the final commits
	}
	ended := time.Now()
	<-fetched
	// The member must rejoin within the session timeout of its last
	// heartbeat: how long the readers took to stop tells whether it can.
	ix.log.Info("group generation ended",
		slog.Int("generation", int(gen.ID)), slog.Duration("readers_stopped_in", time.Since(ended)),
		slog.Int("buffered_messages_dropped", bl.drop(g)))
}

// fetch reads the generation's partitions from their starting offsets
// into the backlog until the generation ends. It never returns before: a
// function of the generation that returns ends it.
//
// It reads with franz-go rather than kafka-go: kafka-go asks for
// read_committed but then hands over aborted records as messages, while
// other producers may write into the topic in transactions; franz-go drops
// them. Transaction markers are kept, as skipped documents, only to have
// their offsets committed.
func (ix *Indexer) fetch(ctx context.Context, g *generation, assigned []kafka.PartitionAssignment, bl *backlog) {
	if len(assigned) == 0 {
		<-ctx.Done() // more members than partitions
		return
	}
	offsets := make(map[int32]kgo.Offset, len(assigned))
	for _, pa := range assigned {
		switch pa.Offset {
		case kafka.FirstOffset:
			offsets[int32(pa.ID)] = kgo.NewOffset().AtStart()
		case kafka.LastOffset:
			offsets[int32(pa.ID)] = kgo.NewOffset().AtEnd()
		default:
			offsets[int32(pa.ID)] = kgo.NewOffset().At(pa.Offset)
		}
	}
	client, err := kgo.NewClient(append([]kgo.Opt{
		kgo.SeedBrokers(ix.cfg.Brokers...),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{ix.cfg.Topic: offsets}),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		// Transaction markers come through as records so that their offsets
		// are committed: a partition that ends with one would otherwise
		// keep a lag of 1 or more for good. Aborted records are still dropped.
		kgo.KeepControlRecords(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), // a committed offset the retention removed
		kgo.FetchMaxWait(250 * time.Millisecond),
		kgo.FetchMaxPartitionBytes(16 << 20),
		kgo.WithLogger(kgoLogger{ix.log}),
	}, ix.cfg.kgoSecurity()...)...)
	if err != nil {
		ix.log.Error("cannot start the partition readers", slog.String("error", err.Error()))
		<-ctx.Done()
		return
	}
	// Closed in the background: Close waits for the client's requests in
	// flight (fetches, offset lookups, each retried for up to 30 s), and
	// the member must rejoin within its session timeout once the
	// generation has ended. Waiting for it here kept readers from stopping
	// for 23–32 s in CI, longer than the 6 s session: each indexer was
	// expelled in turn, rejoined as a new member and ended the other's
	// generation, and the lag stayed put (TestPipelineChaos). Nothing reads
	// from the client once fetch has returned.
	defer func() {
		if ix.closeReader != nil {
			go ix.closeReader(client)
			return
		}
		go client.Close()
	}()
	started, first := time.Now(), true
	var parts []kgo.FetchTopicPartition
	for {
		fetches := client.PollFetches(ctx)
		if ctx.Err() != nil {
			return
		}
		if first && fetches.NumRecords() > 0 {
			first = false
			ix.log.Info("partition readers delivering", slog.Int("generation", int(g.id)), slog.Duration("first_records_after", time.Since(started)))
		}
		fetches.EachError(func(topic string, p int32, err error) {
			// The client retries on its own.
			ix.log.Warn("fetch failed; retrying", slog.String("topic", topic), slog.Int("partition", int(p)), slog.String("error", err.Error()))
		})
		parts = parts[:0]
		fetches.EachPartition(func(fp kgo.FetchTopicPartition) {
			if len(fp.Records) > 0 {
				parts = append(parts, fp)
			}
		})
		delivered := bl.deliver()
		err := ix.putInterleaved(ctx, g, parts, bl)
		delivered()
		clear(parts)
		if err != nil {
			return
		}
	}
}

// putInterleaved puts the fetched partitions' records into the backlog a
// batch of each partition in turn, each partition's in offset order. Put
// one partition after the other, a fetch of several megabytes of one
// partition filled the backlog with that partition alone: its first batch
// made it busy, the other lanes found nothing free and the fetcher waited
// behind the full backlog, so one bulk was in flight at a time
// (bench-indexer: 23,600 docs/s with two lanes, 0.55 of the raw bulk).
// Runs of a whole batch (by count or bytes), not less, so that a lane
// finds a batch of one partition instead of one spread over all of them,
// which would leave every partition busy and the other lanes idle again.
func (ix *Indexer) putInterleaved(ctx context.Context, g *generation, parts []kgo.FetchTopicPartition, bl *backlog) error {
	for left := len(parts); left > 0; {
		left = 0
		for i := range parts {
			// A generation that ended (or a stop) leaves the rest unread:
			// the member must rejoin soon, and its messages are dropped.
			if err := ctx.Err(); err != nil {
				return err
			}
			fp := &parts[i]
			n, size := 0, 0
			// A batch's worth: BatchSize documents or BatchBytes, whichever
			// comes first, so a run never outgrows what one lane takes.
			for n < len(fp.Records) && n < ix.cfg.BatchSize && size < ix.cfg.BatchBytes {
				r := fp.Records[n]
				var d *doc
				if r.Attrs.IsControl() {
					d = &doc{msg: kafkaMessage(r, fp.HighWatermark), skip: SkipTxnMarker}
				} else {
					d = ix.rules.parse(kafkaMessage(r, fp.HighWatermark))
				}
				d.gen = g
				if err := bl.put(ctx, d); err != nil {
					return err
				}
				size += docSize(d)
				n++
			}
			fp.Records = fp.Records[n:]
			if len(fp.Records) > 0 {
				left++
			}
		}
	}
	return nil
}

// kafkaMessage is r as the rest of the indexer reads messages.
func kafkaMessage(r *kgo.Record, highWatermark int64) kafka.Message {
	m := kafka.Message{
		Topic: r.Topic, Partition: int(r.Partition), Offset: r.Offset, HighWaterMark: highWatermark,
		Key: r.Key, Value: r.Value, Time: r.Timestamp,
	}
	if len(r.Headers) > 0 {
		m.Headers = make([]kafka.Header, len(r.Headers))
		for i, h := range r.Headers {
			m.Headers[i] = kafka.Header{Key: h.Key, Value: h.Value}
		}
	}
	return m
}

// resolvedBatch is a batch whose every document is final, on its way to the
// committer.
type resolvedBatch struct {
	docs []*doc
	res  Batch
}

// runLane takes batches from the backlog and resolves them, one at a time.
// A resolved batch goes to the committer before its partitions are
// released, so a partition's next batch is always resolved, and committed,
// after its previous one. The lane does not wait for the commit: its next
// bulk overlaps it.
func (ix *Indexer) runLane(ctx context.Context, bl *backlog, lane int, resolved chan<- resolvedBatch) error {
	for {
		bt, err := bl.take(ctx)
		if err != nil {
			return nil // ctx ended
		}
		startProcessSpans(ctx, bt.docs)
		res, err := ix.resolve(ctx, bt.docs)
		endProcessSpans(bt.docs, err)
		if err != nil {
			if ctx.Err() != nil {
				return nil // abandoned uncommitted: replayed by whoever owns the partitions next
			}
			return err
		}
		res.Lane = lane
		ix.router.finishBulkLoads(ctx, bt.docs)
		hit(FailpointAfterBulk)
		resolved <- resolvedBatch{docs: bt.docs, res: res}
		bl.release(bt)
	}
}

// runCommitter commits resolved batches in the order the lanes resolved
// them, until resolved is closed. Batches that queued up while a commit
// was in flight go into one commit.
func (ix *Indexer) runCommitter(ctx context.Context, resolved <-chan resolvedBatch) {
	var pending []resolvedBatch
	for rb := range resolved {
		pending = append(pending[:0], rb)
	more:
		for {
			select {
			case rb, ok := <-resolved:
				if !ok {
					break more
				}
				pending = append(pending, rb)
			default:
				break more
			}
		}
		ix.commit(ctx, pending)
		hit(FailpointAfterCommit)
		if ix.onBatch != nil {
			for _, rb := range pending {
				ix.onBatch(rb.res)
			}
		}
	}
}

// commit commits the offsets of resolved batches, each under the
// generation that fetched it. They are fully resolved, so the commit goes
// through even when ctx has just ended: that is the point where the work
// is known to be done. A failed commit is not fatal: the messages are
// replayed and the replay is harmless. A batch of a generation that is
// over is not committed at all: its partitions may have moved, and their
// new owners' offsets must not move back.
func (ix *Indexer) commit(ctx context.Context, batches []resolvedBatch) {
	type genOffsets struct {
		offsets map[int]int64
		lag     map[int]int64
		docs    int
	}
	byGen := map[*generation]*genOffsets{}
	var order []*generation
	for _, rb := range batches {
		for _, d := range rb.docs {
			o := byGen[d.gen]
			if o == nil {
				o = &genOffsets{offsets: map[int]int64{}, lag: map[int]int64{}}
				byGen[d.gen] = o
				order = append(order, d.gen)
			}
			o.offsets[d.msg.Partition] = max(o.offsets[d.msg.Partition], d.msg.Offset+1)
			o.lag[d.msg.Partition] = d.msg.HighWaterMark - d.msg.Offset - 1
			o.docs++
		}
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ix.cfg.SessionTimeout)
	defer cancel()
	for _, g := range order {
		o := byGen[g]
		err := g.commit(cctx, ix.cfg.Topic, o.offsets)
		if errors.Is(err, errGenerationEnded) {
			ix.log.Info("batch of an ended group generation not committed; its partitions' owners replay it",
				slog.Int("generation", int(g.id)), slog.Int("docs", o.docs))
			continue
		}
		if err != nil {
			ix.m.commitErrs.Inc()
			ix.log.Warn("offset commit failed; the batch will be replayed", slog.Int("generation", int(g.id)), slog.Int("docs", o.docs), slog.String("error", err.Error()))
			continue
		}
		for p, l := range o.lag {
			ix.m.setLag(p, max(l, 0))
		}
	}
}

// awaitTopic makes sure the topic exists and its partitions have leaders
// before the group is joined: kafka-go's group, joined on a topic that does
// not exist yet, may never consume it once it does (kafka-go issue 1414; it
// happens whenever the indexer starts before the first event is published,
// as in docker compose up). The indexer creates the topic with
// TopicPartitions; when it may not (no permission), it waits for whoever
// may, and says so, within RetryMaxElapsed.
func (ix *Indexer) awaitTopic(ctx context.Context) error {
	c := &kafka.Client{Addr: kafka.TCP(ix.cfg.Brokers...), Timeout: ix.cfg.SessionTimeout, Transport: ix.cfg.kafkaTransport()}
	created := false
	return backoff.RetryNotify(func() error {
		if !created {
			err := ensureTopicVia(ctx, ix.cfg.kafkaTransport(), ix.cfg.Brokers, ix.cfg.Topic, ix.cfg.TopicPartitions)
			if err == nil {
				created = true
			} else if ctx.Err() == nil {
				ix.log.Warn("cannot create the topic; waiting for it to be created",
					slog.String("topic", ix.cfg.Topic), slog.String("error", err.Error()))
			}
		}
		// Leaders are elected a moment after creation; until then the
		// group would see a topic without partitions.
		if _, err := topicOffsets(ctx, c, ix.cfg.Topic, ix.cfg.Group); err != nil {
			if ctx.Err() != nil {
				return backoff.Permanent(ctx.Err())
			}
			return err
		}
		return nil
	}, ix.newBackOff(ctx), func(err error, next time.Duration) {
		ix.log.Info("waiting for the topic before joining the group",
			slog.String("topic", ix.cfg.Topic), slog.String("error", err.Error()), slog.Duration("next", next))
	})
}

func (ix *Indexer) newBackOff(ctx context.Context) backoff.BackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = ix.cfg.RetryInitial
	b.MaxInterval = ix.cfg.RetryMax
	b.MaxElapsedTime = ix.cfg.RetryMaxElapsed
	b.RandomizationFactor = 0.5
	b.Reset()
	return backoff.WithContext(b, ctx)
}

// resolve brings every document of the batch to a final state: indexed,
// conflict (stale or duplicate: the index already holds this version or a
// newer one) or dead-lettered. It returns an error only when that is not
// possible (ctx ended, retries exhausted, dead-letter topic unwritable).
func (ix *Indexer) resolve(ctx context.Context, batch []*doc) (Batch, error) {
	res := Batch{Docs: len(batch)}
	if err := ix.pvGate.check(ctx, batch); err != nil {
		return res, err
	}
	var dead []*doc
	pending := make([]*doc, 0, len(batch))
	for _, d := range batch {
		if d.poison != nil {
			dead = append(dead, d)
			continue
		}
		if d.skip != "" {
			res.Skipped++
			ix.m.docs.WithLabelValues("skipped").Inc()
			ix.m.skipped.WithLabelValues(d.skip).Inc()
			continue
		}
		pending = append(pending, d)
	}
	if err := ix.versionsFromIndex(ctx, pending); err != nil {
		return res, err
	}
	pending = slices.DeleteFunc(pending, func(d *doc) bool {
		if d.overtaken {
			res.Conflicts++
			ix.m.docs.WithLabelValues("conflict").Inc()
		}
		return d.overtaken
	})
	if err := ix.throttle.wait(ctx, len(pending)); err != nil {
		return res, err
	}
	bo := ix.newBackOff(ctx)
	for len(pending) > 0 {
		res.Attempts++
		var retry []*doc
		var reqErr error
		saw429 := false
		started := time.Now()
		sent := 0
		for _, part := range ix.bulkBisect(ctx, pending) {
			chunk, results, err := part.docs, part.results, part.err
			if err != nil {
				if ctx.Err() != nil {
					return res, ctx.Err()
				}
				if !index.IsRetryable(err) {
					return res, fmt.Errorf("bulk request to %s refused: %w", ix.cfg.WriteAlias, err)
				}
				saw429 = saw429 || elastic.IsStatusCode(err, http.StatusTooManyRequests)
				reqErr = err
				ix.m.retries.WithLabelValues(retryRequest).Add(float64(len(chunk)))
				retry = append(retry, chunk...)
				continue
			}
			sent += len(chunk)
			for i, r := range results {
				d := chunk[i]
				switch r.outcome() {
				case outcomeIndexed:
					res.Indexed++
					if d.op == opDelete {
						ix.m.docs.WithLabelValues("deleted").Inc()
					} else {
						ix.m.docs.WithLabelValues("indexed").Inc()
					}
				case outcomeConflict:
					res.Conflicts++
					ix.m.docs.WithLabelValues("conflict").Inc()
				case outcomeRetry:
					if r.Status == http.StatusTooManyRequests {
						saw429 = true
						ix.m.retries.WithLabelValues(retryItem429).Inc()
					} else if r.Status >= 500 {
						ix.m.retries.WithLabelValues(retryItem5xx).Inc()
					} else {
						ix.m.retries.WithLabelValues(retryItemOther).Inc()
					}
					if reqErr == nil {
						reqErr = r.itemError()
					}
					retry = append(retry, d)
				case outcomePermanent:
					d.poison = r.itemError()
					dead = append(dead, d)
				}
			}
		}
		if elapsed := time.Since(started).Seconds(); elapsed > 0 {
			if saw429 {
				ix.throttle.overloaded(float64(sent) / elapsed)
			} else if len(retry) == 0 {
				ix.throttle.healthy(float64(sent) / elapsed)
			}
		}
		pending = retry
		if len(pending) == 0 {
			break
		}
		wait := bo.NextBackOff()
		if wait == backoff.Stop {
			if ctx.Err() != nil {
				return res, ctx.Err()
			}
			return res, fmt.Errorf("%w: %d document(s) still refused after %s: %v", ErrRetriesExhausted, len(pending), ix.cfg.RetryMaxElapsed, reqErr)
		}
		ix.log.Warn("retrying bulk items", slog.Int("items", len(pending)), slog.Int("attempt", res.Attempts), slog.Duration("wait", wait), slog.Any("error", reqErr))
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return res, ctx.Err()
		}
	}
	if len(dead) > 0 {
		if err := ix.dlq.write(ctx, ix.cfg, dead); err != nil {
			return res, err
		}
		for _, d := range dead {
			ix.m.docs.WithLabelValues("dead_lettered").Inc()
			ix.m.deadLetters.WithLabelValues(d.poison.Code).Inc()
			ix.log.Warn("message dead-lettered",
				slog.String("id", d.id), slog.Int("partition", d.msg.Partition), slog.Int64("offset", d.msg.Offset),
				slog.String("code", d.poison.Code), slog.String("reason", d.poison.Reason), slog.String("traceparent", traceparent(d.msg)))
		}
		res.Dead = len(dead)
	}
	return res, nil
}

func (e *itemError) Error() string {
	return fmt.Sprintf("%s (status %d): %s", e.Code, e.Status, e.Reason)
}

// bulk writes docs, each through the alias of its target: its processor
// version's index generation (created on first sight), or the write alias.
func (ix *Indexer) bulk(ctx context.Context, docs []*doc) ([]bulkItemResult, error) {
	ctx, span := startBulkSpan(ctx, docs)
	defer span.End()
	ctx, cancel := context.WithTimeout(ctx, ix.cfg.RequestTimeout)
	defer cancel()
	if err := ix.router.route(ctx, docs); err != nil {
		return nil, err
	}
	start := time.Now()
	res, size, err := sendBulk(ctx, ix.client, docs)
	took := time.Since(start)
	ix.m.bulkSeconds.Observe(took.Seconds())
	if ix.cfg.BulkObserver != nil {
		ix.cfg.BulkObserver(len(docs), size, took)
	}
	ix.m.bulkDocs.Observe(float64(len(docs)))
	ix.m.bulkBytes.Observe(float64(size))
	return res, err
}

func traceparent(m kafka.Message) string {
	v, _ := header(m, "traceparent")
	return v
}
