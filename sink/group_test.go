package sink

import (
	"context"
	"fmt"
	"testing"
	"time"

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
