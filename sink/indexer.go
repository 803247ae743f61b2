package sink

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/olivere/elastic/v7"
	"github.com/segmentio/kafka-go"
	"golang.org/x/sync/errgroup"

	"github.com/outboxrelay/outboxrelay/internal/failpoint"
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
	dlq      *deadLetterWriter
	throttle *throttle
	m        *metrics
	// onBatch, if set, is called after every resolved and committed batch
	// (tests).
	onBatch func(Batch)
}

// Batch describes one resolved batch, for [Config] observers and tests.
type Batch struct {
	Lane                                     int
	Docs, Indexed, Conflicts, Dead, Attempts int
}

// New validates cfg and builds an Indexer. It does not touch the network.
func New(cfg Config) (*Indexer, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, &ConfigError{Err: err}
	}
	client, err := NewClient(cfg.URL)
	if err != nil {
		return nil, &ConfigError{Err: err}
	}
	m := newMetrics(cfg.Registerer)
	return &Indexer{
		cfg:      cfg,
		log:      cfg.Logger,
		client:   client,
		dlq:      newDeadLetterWriter(cfg),
		throttle: newThrottle(cfg.MaxRate, cfg.BatchSize, m.rateLimit.Set),
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
	var index string
	err := backoff.RetryNotify(func() error {
		var err error
		if index, err = EnsureIndex(ctx, ix.client, ix.cfg.Alias, ix.cfg.WriteAlias, ix.cfg.Mapping); err != nil {
			if !IsRetryable(err) || errors.Is(err, ErrWriteAliasMissing) {
				return backoff.Permanent(err)
			}
			return err
		}
		return ensureTopic(ctx, ix.cfg.Brokers, ix.cfg.DeadLetterTopic, 1)
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
		slog.String("write_alias", ix.cfg.WriteAlias), slog.String("index", index),
		slog.Int("lanes", ix.cfg.Lanes), slog.Int("batch_size", ix.cfg.BatchSize))

	reader := kafka.NewReader(kafka.ReaderConfig{
		Brokers:           ix.cfg.Brokers,
		GroupID:           ix.cfg.Group,
		Topic:             ix.cfg.Topic,
		MinBytes:          1,
		MaxBytes:          16 << 20,
		MaxWait:           250 * time.Millisecond,
		QueueCapacity:     ix.cfg.BatchSize,
		CommitInterval:    0, // synchronous: CommitMessages returns once the broker has the offsets
		StartOffset:       kafka.FirstOffset,
		SessionTimeout:    ix.cfg.SessionTimeout,
		HeartbeatInterval: ix.cfg.HeartbeatInterval,
		RebalanceTimeout:  ix.cfg.SessionTimeout,
		JoinGroupBackoff:  time.Second,
		ReadLagInterval:   -1,
		// A topic created after the group joined (the publisher creates it
		// with its first event), or given more partitions later, triggers a
		// rebalance instead of leaving the indexer idle.
		WatchPartitionChanges:  true,
		PartitionWatchInterval: 2 * time.Second,
		ErrorLogger: kafka.LoggerFunc(func(msg string, args ...any) {
			ix.log.Warn("kafka reader", slog.String("error", fmt.Sprintf(msg, args...)))
		}),
	})
	defer reader.Close()
	defer ix.dlq.Close()

	bl := newBacklog(ix.cfg)
	resolved := make(chan resolvedBatch, ix.cfg.Lanes)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		var fetchRetry backoff.BackOff // set while fetches fail
		for {
			m, err := reader.FetchMessage(gctx)
			if err != nil {
				if gctx.Err() != nil {
					return nil
				}
				// The reader reports a group it could not rejoin (a
				// rebalance in progress, a member id the coordinator
				// dropped while this process was stalled) and keeps
				// trying on its own: wait and fetch again, within the
				// retry budget.
				if fetchRetry == nil {
					fetchRetry = ix.newBackOff(gctx)
				}
				next := fetchRetry.NextBackOff()
				if next == backoff.Stop {
					return fmt.Errorf("fetch from %s: %w", ix.cfg.Topic, err)
				}
				ix.log.Warn("fetch failed; retrying", slog.String("error", err.Error()), slog.Duration("next", next))
				select {
				case <-time.After(next):
				case <-gctx.Done():
					return nil
				}
				continue
			}
			fetchRetry = nil
			if bl.put(gctx, parse(m, ix.cfg.MaxDocumentBytes)) != nil {
				return nil
			}
		}
	})
	for lane := range ix.cfg.Lanes {
		g.Go(func() error { return ix.runLane(gctx, bl, lane, resolved) })
	}
	// The committer outlives the lanes: whatever they resolved before
	// stopping is still committed.
	committerDone := make(chan struct{})
	guard := &staleCommitGuard{reader: reader, client: &kafka.Client{Addr: kafka.TCP(ix.cfg.Brokers...), Timeout: ix.cfg.SessionTimeout},
		group: ix.cfg.Group, topic: ix.cfg.Topic}
	go func() {
		defer close(committerDone)
		ix.runCommitter(gctx, reader, guard, resolved)
	}()
	err = g.Wait()
	close(resolved)
	<-committerDone
	if err == nil && ctx.Err() != nil {
		ix.log.Info("indexer stopped")
	}
	return err
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
		res, err := ix.resolve(ctx, bt.docs)
		if err != nil {
			if ctx.Err() != nil {
				return nil // abandoned uncommitted: replayed by whoever owns the partitions next
			}
			return err
		}
		res.Lane = lane
		failpoint.Hit(FailpointAfterBulk)
		resolved <- resolvedBatch{docs: bt.docs, res: res}
		bl.release(bt)
	}
}

// runCommitter commits resolved batches in the order the lanes resolved
// them, until resolved is closed. Batches that queued up while a commit
// was in flight go into one commit.
func (ix *Indexer) runCommitter(ctx context.Context, reader *kafka.Reader, guard *staleCommitGuard, resolved <-chan resolvedBatch) {
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
		ix.commit(ctx, reader, guard, pending)
		failpoint.Hit(FailpointAfterCommit)
		if ix.onBatch != nil {
			for _, rb := range pending {
				ix.onBatch(rb.res)
			}
		}
	}
}

// commit commits the offsets of resolved batches. They are fully
// resolved, so the commit goes through even when ctx has just ended: that
// is the point where the work is known to be done. A failed commit is not
// fatal: the messages are replayed and the replay is harmless. After a
// rebalance, the guard keeps a batch fetched before it from moving a
// partition's offset back.
func (ix *Indexer) commit(ctx context.Context, reader *kafka.Reader, guard *staleCommitGuard, batches []resolvedBatch) {
	var msgs []kafka.Message
	lag := map[int]int64{}
	for _, rb := range batches {
		for _, d := range rb.docs {
			msgs = append(msgs, d.msg)
			lag[d.msg.Partition] = d.msg.HighWaterMark - d.msg.Offset - 1
		}
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ix.cfg.SessionTimeout)
	defer cancel()
	if msgs = guard.filter(cctx, msgs); len(msgs) == 0 {
		return
	}
	if err := reader.CommitMessages(cctx, msgs...); err != nil {
		ix.m.commitErrs.Inc()
		ix.log.Warn("offset commit failed; the batch will be replayed", slog.Int("docs", len(msgs)), slog.String("error", err.Error()))
		return
	}
	for p, l := range lag {
		ix.m.setLag(p, max(l, 0))
	}
}

// staleCommitGuard keeps offsets from moving back after a rebalance.
// kafka-go's Reader commits every offset with the group generation current
// at commit time, and the broker does not check that the member still owns
// the partition: a batch fetched before a rebalance and committed after it
// moves the partition's offset back behind what its new owner committed,
// and nothing moves it forward again until new messages arrive (the
// messages are only replayed, harmlessly, but the lag stays up). For
// guardWindow after a rebalance (this member's first join excepted), the
// guard reads the group's committed offsets before each commit and drops
// the partitions already committed at or past the batch.
type staleCommitGuard struct {
	reader       *kafka.Reader
	client       *kafka.Client
	group, topic string

	rebalances int64     // seen so far (Stats resets the reader's counters: the committer is its only caller)
	until      time.Time // the guard is on until then
}

// guardWindow is how long after a rebalance batches fetched before it may
// still be committed: the backlog and the lanes drain well within it.
const guardWindow = time.Minute

func (g *staleCommitGuard) filter(ctx context.Context, msgs []kafka.Message) []kafka.Message {
	if n := g.reader.Stats().Rebalances; n > 0 {
		if g.rebalances += n; g.rebalances > 1 {
			g.until = time.Now().Add(guardWindow)
		}
	}
	if time.Now().After(g.until) {
		return msgs
	}
	last := map[int]int64{}
	for _, m := range msgs {
		last[m.Partition] = max(last[m.Partition], m.Offset)
	}
	parts := make([]int, 0, len(last))
	for p := range last {
		parts = append(parts, p)
	}
	resp, err := g.client.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: g.group, Topics: map[string][]int{g.topic: parts}})
	if err != nil || resp.Error != nil {
		return msgs // commit as before; a rollback only replays
	}
	ahead := map[int]bool{}
	for _, p := range resp.Topics[g.topic] {
		if p.Error == nil && p.CommittedOffset > last[p.Partition] {
			ahead[p.Partition] = true
		}
	}
	if len(ahead) == 0 {
		return msgs
	}
	kept := msgs[:0:0]
	for _, m := range msgs {
		if !ahead[m.Partition] {
			kept = append(kept, m)
		}
	}
	return kept
}

// awaitTopic makes sure the topic exists and its partitions have leaders
// before the group is joined: kafka-go's group, joined on a topic that does
// not exist yet, may never consume it once it does (kafka-go issue 1414; it
// happens whenever the indexer starts before the first event is published,
// as in docker compose up). The indexer creates the topic with
// TopicPartitions; when it may not (no permission), it waits for whoever
// may, and says so.
func (ix *Indexer) awaitTopic(ctx context.Context) error {
	c := &kafka.Client{Addr: kafka.TCP(ix.cfg.Brokers...), Timeout: ix.cfg.SessionTimeout}
	created := false
	bo := backoff.WithContext(backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(100*time.Millisecond), backoff.WithMaxInterval(5*time.Second), backoff.WithMaxElapsedTime(0)), ctx)
	return backoff.RetryNotify(func() error {
		if !created {
			err := ensureTopic(ctx, ix.cfg.Brokers, ix.cfg.Topic, ix.cfg.TopicPartitions)
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
	}, bo, func(err error, next time.Duration) {
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
	var dead []*doc
	pending := make([]*doc, 0, len(batch))
	for _, d := range batch {
		if d.poison != nil {
			dead = append(dead, d)
			continue
		}
		pending = append(pending, d)
	}
	if err := ix.throttle.wait(ctx, len(pending)); err != nil {
		return res, err
	}
	bo := ix.newBackOff(ctx)
	var buf bytes.Buffer
	oneByOne := false // after a 413: the request, not an item, was too large
	for len(pending) > 0 {
		res.Attempts++
		step := len(pending)
		if oneByOne {
			step = 1
		}
		var retry []*doc
		var reqErr error
		saw429 := false
		started := time.Now()
		sent := 0
		for lo := 0; lo < len(pending); lo += step {
			chunk := pending[lo:min(lo+step, len(pending))]
			results, err := ix.bulk(ctx, chunk, &buf)
			if err != nil {
				if ctx.Err() != nil {
					return res, ctx.Err()
				}
				if elastic.IsStatusCode(err, http.StatusRequestEntityTooLarge) {
					if len(chunk) > 1 {
						oneByOne = true
						retry = append(retry, pending[lo:]...)
						break
					}
					chunk[0].poison = &itemError{Code: CodeDocumentTooLarge, Reason: "the engine refused the request as too large", Status: http.StatusRequestEntityTooLarge}
					dead = append(dead, chunk[0])
					continue
				}
				if !IsRetryable(err) {
					return res, fmt.Errorf("bulk request to %s refused: %w", ix.cfg.WriteAlias, err)
				}
				saw429 = saw429 || elastic.IsStatusCode(err, http.StatusTooManyRequests)
				reqErr = err
				ix.m.retries.WithLabelValues("request").Add(float64(len(chunk)))
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
						ix.m.retries.WithLabelValues("item_429").Inc()
					} else if r.Status >= 500 {
						ix.m.retries.WithLabelValues("item_5xx").Inc()
					} else {
						ix.m.retries.WithLabelValues("item_other").Inc()
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

func (ix *Indexer) bulk(ctx context.Context, docs []*doc, buf *bytes.Buffer) ([]bulkItemResult, error) {
	ctx, cancel := context.WithTimeout(ctx, ix.cfg.RequestTimeout)
	defer cancel()
	start := time.Now()
	res, err := sendBulk(ctx, ix.client, ix.cfg.WriteAlias, docs, buf)
	took := time.Since(start)
	ix.m.bulkSeconds.Observe(took.Seconds())
	if ix.cfg.BulkObserver != nil {
		ix.cfg.BulkObserver(len(docs), buf.Len(), took)
	}
	ix.m.bulkDocs.Observe(float64(len(docs)))
	ix.m.bulkBytes.Observe(float64(buf.Len()))
	return res, err
}

func traceparent(m kafka.Message) string {
	v, _ := header(m, "traceparent")
	return v
}
