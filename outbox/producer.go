package outbox

import (
	"bytes"
	"context"
	"io"
	"net"
	"sync"
	"time"

	"github.com/outboxrelay/outboxrelay/internal/kafkakey"
	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/compress"
)

// producer sends records with kafka-go's Client: one Produce request per
// partition of a call, each bounded by the call's context and nothing else.
//
// It replaces kafka.Writer, which sends the batches of a call from
// goroutines of its own on a context of its own (context.Background plus
// WriteTimeout): a WriteMessages call that gave up on its context leaves
// them queued, they go out whenever the broker answers again, and Close
// flushes them. A publisher that lost a shard's lease could so send an old
// batch after the shard's new owner had sent newer events of the same keys.
// Here a request lives and dies with the attempt that made it: its
// connection is set up, written and read under the attempt's deadline (the
// transport sets that deadline on the socket), and when write returns no
// request of the call is waiting anywhere to be sent later.
type producer struct {
	client   *kafka.Client
	balancer kafka.Balancer // kafkakey.Balancer: the partition every stage agrees on
	codec    compress.Compression
	ackWait  time.Duration // how long an attempt waits for answers after its cut (WriteTimeout)

	mu    sync.Mutex
	parts map[string]topicParts // partition counts, from the transport's metadata cache
	// unavailable is when each topic was first found missing or forbidden
	// (topicUnavailable) since it last worked.
	unavailable map[string]time.Time
	// listed is Config.Topics by name; nil allows every topic.
	listed map[string]bool
}

type topicParts struct {
	n       int
	err     error
	fetched time.Time
}

// partsTTL is how long a topic's partition count is reused before the
// transport's cache (itself refreshed every MetadataTTL) is asked again.
const partsTTL = time.Second

func newProducer(transport *kafka.Transport, brokers []string, topics []TopicSpec, codec compress.Compression, ackWait time.Duration) *producer {
	pr := &producer{
		codec:   codec,
		ackWait: ackWait,
		// The client's Timeout is longer than any attempt (at most twice
		// ackWait, see attemptDeadline), so the deadline it sets on each
		// call is the attempt's own, mark and cut kept. It is there for
		// what kafka-go derives from it: without one, the produce timeout
		// the broker gets (how long acks=all may wait for the in-sync
		// replicas) is a fixed 500 ms; with one it is half of what is left
		// of the attempt.
		client:   &kafka.Client{Addr: kafka.TCP(brokers...), Transport: transport, Timeout: 2*ackWait + time.Minute},
		balancer: kafkakey.Balancer(),
		parts:    map[string]topicParts{},

		unavailable: map[string]time.Time{},
	}
	if len(topics) > 0 {
		pr.listed = map[string]bool{}
		for _, t := range topics {
			pr.listed[t.Name] = true
		}
	}
	return pr
}

// partitions returns the partition count of each topic of msgs; a topic
// whose metadata failed has its error instead.
func (pr *producer) partitions(ctx context.Context, msgs []kafka.Message) (map[string]topicParts, error) {
	now := time.Now()
	out := map[string]topicParts{}
	var missing []string
	pr.mu.Lock()
	for i := range msgs {
		t := msgs[i].Topic
		if _, ok := out[t]; ok {
			continue
		}
		if pr.listed != nil && !pr.listed[t] {
			// Not asked for: the broker may have it, the deployment does not.
			out[t] = topicParts{err: ErrTopicNotListed, fetched: now}
			pr.noteLocked(t, ErrTopicNotListed, now)
			continue
		}
		tp, ok := pr.parts[t]
		if ok && now.Sub(tp.fetched) < partsTTL {
			out[t] = tp
		} else {
			out[t] = topicParts{}
			missing = append(missing, t)
		}
	}
	pr.mu.Unlock()
	if len(missing) == 0 {
		return out, nil
	}
	meta, err := pr.client.Metadata(ctx, &kafka.MetadataRequest{Topics: missing})
	if err != nil {
		return nil, err
	}
	pr.mu.Lock()
	defer pr.mu.Unlock()
	for _, t := range missing {
		tp := topicParts{err: kafka.UnknownTopicOrPartition, fetched: now}
		for _, mt := range meta.Topics {
			if mt.Name == t {
				tp = topicParts{n: len(mt.Partitions), err: mt.Error, fetched: now}
				if tp.err == nil && tp.n == 0 {
					tp.err = kafka.LeaderNotAvailable
				}
				break
			}
		}
		if tp.err == nil {
			pr.parts[t] = tp
		} else {
			delete(pr.parts, t) // ask again next time
		}
		pr.noteLocked(t, tp.err, now)
		out[t] = tp
	}
	return out, nil
}

// write sends msgs, each partition's share as one Produce request with
// acks=all, and returns nil, a [kafka.WriteErrors] with one entry per
// message, or an error that concerns the whole call. A topic whose
// metadata fails fails its own messages only. It returns once every request
// has finished or failed: with a context deadline, no byte of the call is
// written after that deadline.
func (pr *producer) write(ctx context.Context, msgs []kafka.Message) error {
	parts, err := pr.partitions(ctx, msgs)
	if err != nil {
		return err
	}
	type key struct {
		topic     string
		partition int
	}
	groups := map[key][]int{}
	werrs := make(kafka.WriteErrors, len(msgs))
	failed := false
	var lastTopic string
	var ids []int // partitionList of lastTopic
	for i := range msgs {
		tp := parts[msgs[i].Topic]
		if tp.err != nil {
			werrs[i], failed = tp.err, true
			continue
		}
		if ids == nil || msgs[i].Topic != lastTopic {
			lastTopic, ids = msgs[i].Topic, partitionList(tp.n)
		}
		k := key{msgs[i].Topic, pr.balancer.Balance(msgs[i], ids...)}
		groups[k] = append(groups[k], i)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	for k, idx := range groups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := pr.client.Produce(ctx, &kafka.ProduceRequest{
				Topic: k.topic, Partition: k.partition, RequiredAcks: kafka.RequireAll, Compression: pr.codec,
				Records: newMessageRecords(msgs, idx),
			})
			if err == nil && res.Error != nil {
				err = res.Error
			}
			pr.mu.Lock()
			pr.noteLocked(k.topic, err, time.Now())
			pr.mu.Unlock()
			if err != nil {
				mu.Lock()
				for _, i := range idx {
					werrs[i] = err
				}
				failed = true
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if !failed {
		return nil
	}
	return werrs
}

// noteLocked records whether topic is unavailable after a result with err.
// Called with pr.mu held.
func (pr *producer) noteLocked(topic string, err error, now time.Time) {
	switch {
	case err == nil:
		delete(pr.unavailable, topic)
	case topicUnavailable(err):
		if _, ok := pr.unavailable[topic]; !ok {
			pr.unavailable[topic] = now
		}
	}
}

// unavailableFor is how long topic has been missing or forbidden (0 when it
// is not).
func (pr *producer) unavailableFor(topic string) time.Duration {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	since, ok := pr.unavailable[topic]
	if !ok {
		return 0
	}
	return time.Since(since)
}

var partitionIDs struct {
	sync.Mutex
	ids []int
}

// partitionList is [0, n) from a shared slice (Balance takes a list).
func partitionList(n int) []int {
	partitionIDs.Lock()
	defer partitionIDs.Unlock()
	for len(partitionIDs.ids) < n {
		partitionIDs.ids = append(partitionIDs.ids, len(partitionIDs.ids))
	}
	return partitionIDs.ids[:n:n]
}

// messageRecords reads messages as records (as kafka.Writer's own adapter
// does). It holds its own copy of the Message values: a request that gave
// up on its deadline may still be encoded by the transport's connection
// goroutine (until the same deadline) while the caller builds the next
// attempt's message list. The byte slices are shared; the batch that owns
// them is not reused after a failed attempt (publishBatch).
type messageRecords struct {
	msgs       []kafka.Message
	next       int
	record     kafka.Record
	key, value bytesReadCloser
}

func newMessageRecords(msgs []kafka.Message, idx []int) *messageRecords {
	r := &messageRecords{msgs: make([]kafka.Message, len(idx))}
	for j, i := range idx {
		r.msgs[j] = msgs[i]
	}
	return r
}

func (r *messageRecords) ReadRecord() (*kafka.Record, error) {
	if r.next >= len(r.msgs) {
		return nil, io.EOF
	}
	m := &r.msgs[r.next]
	r.next++
	r.record = kafka.Record{Time: m.Time, Headers: m.Headers}
	if m.Key != nil {
		r.key.Reset(m.Key)
		r.record.Key = &r.key
	}
	if m.Value != nil {
		r.value.Reset(m.Value)
		r.record.Value = &r.value
	}
	return &r.record, nil
}

type bytesReadCloser struct{ bytes.Reader }

func (*bytesReadCloser) Close() error { return nil }

// attemptDeadline is the context deadline of a produce attempt that may
// write until cut and then wait ackWait for the answers. kafka-go sets a
// request's context deadline on its connection for writes and reads alike
// (and gives the broker half of what is left of it as the produce timeout,
// see newProducer); cutConn takes the two apart again, so the writes stop
// at cut while the answer may come until the deadline. Giving up on an
// answer at cut would not take back what was written: the broker appends
// it anyway, and the retry writes the records a second time, and a third,
// for as long as the broker is slower than the lease allows for writing.
//
// The deadline carries a mark, cutMark nanoseconds into its microsecond, by
// which cutConn tells it from the deadlines kafka-go sets itself (the
// handshake of a new connection, its background metadata refresh), which it
// leaves whole. It is moved back, never forward, so the cut it gives back
// is never later than cut, and it keeps cut's monotonic clock reading (a
// step of the wall clock moves no deadline). A deadline of kafka-go's own
// that happens to carry the mark (one in a thousand) gets a write deadline
// ackWait too early: that handshake or refresh fails and is tried again, and
// nothing is written late. The producer's client's Timeout is longer than
// any attempt (newProducer): a shorter deadline of its own would replace
// the attempt's, mark and cut with it.
func attemptDeadline(cut time.Time, ackWait time.Duration) time.Time {
	d := cut.Add(ackWait)
	into := time.Duration(d.Nanosecond()) % time.Microsecond
	return d.Add(cutMark - into - time.Microsecond)
}

// attemptDeadline is the deadline of an attempt that writes until cut, with
// the producer's ackWait: the one its connections (cutDial) split by.
func (pr *producer) attemptDeadline(cut time.Time) time.Time { return attemptDeadline(cut, pr.ackWait) }

// cutMark is the nanosecond within its microsecond that marks an
// attemptDeadline.
const cutMark = 777 * time.Nanosecond

func isAttemptDeadline(d time.Time) bool {
	return time.Duration(d.Nanosecond())%time.Microsecond == cutMark
}

// cutDial wraps dial's connections in cutConn with ackWait, the publisher's
// WriteTimeout. Only the producer uses these connections, and each of its
// requests runs under an attemptDeadline.
func cutDial(dial func(ctx context.Context, network, address string) (net.Conn, error), ackWait time.Duration) func(ctx context.Context, network, address string) (net.Conn, error) {
	return func(ctx context.Context, network, address string) (net.Conn, error) {
		c, err := dial(ctx, network, address)
		if err != nil {
			return nil, err
		}
		return &cutConn{Conn: c, ackWait: ackWait}, nil
	}
}

// cutConn is a broker connection on which an attemptDeadline d lets writes
// go on until d minus ackWait, the attempt's cut, and reads until d. A write
// that reaches the cut fails, and the half-written request with it: the
// broker never reads a request that did not arrive whole. Other deadlines
// apply to both, as on any connection.
type cutConn struct {
	net.Conn
	ackWait time.Duration
}

func (c *cutConn) SetDeadline(d time.Time) error {
	if d.IsZero() || !isAttemptDeadline(d) {
		return c.Conn.SetDeadline(d)
	}
	if err := c.Conn.SetWriteDeadline(d.Add(-c.ackWait)); err != nil {
		return err
	}
	return c.Conn.SetReadDeadline(d)
}
