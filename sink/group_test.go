package sink

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// An indexer started before its topic exists (docker compose up, a new
// deployment) consumes what is published afterwards. kafka-go's group
// joined on a missing topic could stay idle for good (kafka-go issue 1414),
// so several fresh topics are tried to catch the race.
func TestIndexerStartedBeforeItsTopicExists(t *testing.T) {
	t.Parallel()
	es := stack.ElasticsearchURL(t)
	for i := range 5 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			f := newFixture(t, es, es, 0)
			f.writer.AllowAutoTopicCreation = true // as the publisher writes today
			f.start(f.cfg)
			eventually(t, time.Minute, func() error { // the indexer has joined its group
				n, err := groupMembers(f, f.cfg.Group)
				if err != nil || n != 1 {
					return fmt.Errorf("%d members (%v)", n, err)
				}
				return nil
			})
			const n = 50
			recs := make([]rec, n)
			for k := range recs {
				recs[k] = upsert(fmt.Sprintf("t-%02d", k), 1, docN(k))
			}
			f.produce(recs...)
			eventually(t, time.Minute, func() error {
				if got := len(f.search(f.cfg.Alias)); got != n {
					return fmt.Errorf("%d of %d documents indexed", got, n)
				}
				return nil
			})
			f.waitCaughtUp(f.cfg.Group, time.Minute)
			parts, err := topicPartitions(context.Background(), f.kclient, f.cfg.Topic)
			require.NoError(t, err)
			require.Len(t, parts, DefaultTopicPartitions, "the indexer created the topic with TOPIC_PARTITIONS")
		})
	}
}

// member is one in-process indexer of a group that a test can stop.
type member struct {
	stop func()
	done chan error
}

func (f *fixture) join(cfg Config) *member {
	f.t.Helper()
	ix, err := New(cfg)
	require.NoError(f.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	m := &member{stop: cancel, done: make(chan error, 1)}
	go func() { m.done <- ix.Run(ctx) }()
	f.t.Cleanup(func() { cancel(); <-m.done })
	return m
}

func (m *member) leave(t *testing.T) {
	t.Helper()
	m.stop()
	select {
	case err := <-m.done:
		require.NoError(t, err)
		m.done <- nil // for the cleanup
	case <-time.After(time.Minute):
		t.Fatal("indexer did not stop")
	}
}

// Members join and leave the group while messages keep arriving (10,000
// updates of 500 ids). Offsets
// are committed under the generation that fetched them, so a batch
// fetched before a rebalance never moves a partition's committed offset
// back behind what its new owner committed; nothing is lost and the lag
// returns to 0.
func TestMembersJoinAndLeaveUnderLoad(t *testing.T) {
	t.Parallel()
	es := stack.ElasticsearchURL(t)
	f := newFixture(t, es, es, 6)
	cfg := f.cfg
	cfg.BatchSize = 50
	cfg.MaxRate = 800 // per member: the stream outlasts the membership changes

	// Watch the committed offsets: none may ever move back.
	var backwards []string
	watchCtx, stopWatch := context.WithCancel(context.Background())
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		last := map[int]int64{}
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for ; watchCtx.Err() == nil; <-tick.C {
			ctx, cancel := context.WithTimeout(watchCtx, 5*time.Second)
			po, err := topicOffsets(ctx, f.kclient, cfg.Topic, cfg.Group)
			cancel()
			if err != nil {
				continue
			}
			for _, p := range po {
				if p.Committed >= 0 && p.Committed < last[p.Partition] {
					backwards = append(backwards, fmt.Sprintf("partition %d: %d after %d", p.Partition, p.Committed, last[p.Partition]))
					last[p.Partition] = p.Committed // report each move back once
				}
				last[p.Partition] = max(last[p.Partition], p.Committed)
			}
		}
	}()

	const ids, versions = 500, 20
	produced := make(chan error, 1)
	go func() { // the load: every id updated again and again, a little ahead of the indexers
		produced <- func() error {
			tick := time.NewTicker(20 * time.Millisecond)
			defer tick.Stop()
			deadline := time.Now().Add(3 * time.Minute)
			for v := int64(1); v <= versions; v++ {
				for v > 3 && time.Now().Before(deadline) {
					po, err := topicOffsets(context.Background(), f.kclient, cfg.Topic, cfg.Group)
					if err == nil && committedSum(po) >= (v-3)*ids {
						break
					}
					<-tick.C
				}
				msgs := make([]kafka.Message, ids)
				for i := range msgs {
					msgs[i] = upsert(fmt.Sprintf("m-%03d", i), v, docN(i*100+int(v))).message()
				}
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				err := f.writer.WriteMessages(ctx, msgs...)
				cancel()
				if err != nil {
					return fmt.Errorf("produce version %d: %w", v, err)
				}
			}
			return nil
		}()
	}()
	progress := func(n int64) {
		t.Helper()
		eventually(t, 2*time.Minute, func() error {
			if c := committedSum(f.offsets(cfg.Group)); c < n {
				return fmt.Errorf("%d committed, want %d", c, n)
			}
			return nil
		})
	}
	a := f.join(cfg)
	progress(500)
	b := f.join(cfg)
	progress(2000)
	c := f.join(cfg)
	progress(3500)
	a.leave(t)
	progress(5000)
	d := f.join(cfg)
	progress(6500)
	b.leave(t)
	progress(8000)
	require.Less(t, committedSum(f.offsets(cfg.Group)), int64(ids*versions), "the changes must happen under load")
	require.NoError(t, <-produced)
	f.waitCaughtUp(cfg.Group, 3*time.Minute)
	stopWatch()
	<-watched
	require.Empty(t, backwards, "committed offsets moved back")

	seen := f.search(cfg.Alias)
	require.Len(t, seen, ids)
	for i := range ids {
		id := fmt.Sprintf("m-%03d", i)
		require.Equal(t, fmt.Sprintf("v%d %s", versions, docN(i*100+versions)), seen[id], id)
	}
	c.leave(t)
	d.leave(t)
}
