package sink

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// Another producer writes into the topic in transactions and aborts one:
// the indexer reads committed records only, so the aborted ones are never
// indexed (franz-go as the transactional producer: kafka-go has none). The
// partition ends with a transaction marker, which is no record: the group
// must still commit past it, or its lag stays above 0 for good.
func TestAbortedTransactionsAreNeverIndexed(t *testing.T) {
	t.Parallel()
	es := stack.ElasticsearchURL(t)
	f := newFixture(t, es, es, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(f.cfg.Brokers...),
		kgo.DefaultProduceTopic(f.cfg.Topic),
		kgo.TransactionalID(stack.UniqueName("txn")),
		kgo.RecordPartitioner(kgo.ManualPartitioner()),
	)
	require.NoError(t, err)
	defer cl.Close()
	txn := func(prefix string, n int, end kgo.TransactionEndTry) {
		t.Helper()
		require.NoError(t, cl.BeginTransaction())
		for i := range n {
			m := upsert(fmt.Sprintf("%s-%02d", prefix, i), 1, docN(i)).message()
			r := &kgo.Record{Key: m.Key, Value: m.Value, Partition: 0}
			for _, h := range m.Headers {
				r.Headers = append(r.Headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
			}
			require.NoError(t, cl.ProduceSync(ctx, r).FirstErr())
		}
		require.NoError(t, cl.EndTransaction(ctx, end))
	}
	f.start(f.cfg)
	txn("aborted", 20, kgo.TryAbort)
	f.produce(upsert("plain", 1, docN(1))) // not transactional
	txn("committed", 20, kgo.TryCommit)
	txn("aborted-too", 5, kgo.TryAbort)

	f.waitCaughtUp(f.cfg.Group, time.Minute)
	seen := f.search(f.cfg.Alias)
	want := map[string]bool{"plain": true}
	for i := range 20 {
		want["committed-"+fmt.Sprintf("%02d", i)] = true
	}
	got := map[string]bool{}
	for id := range seen {
		got[id] = true
	}
	require.Equal(t, want, got, "only committed records are indexed")
}
