package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// An id sequence with CACHE > 1 hands each session ids from a block of its
// own, so a later commit of one aggregate can get a lower id: the publisher
// refuses to start and says how to fix it; with CACHE 1 again it runs.
func TestRefuseCachedIDSequence(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	brokers := stack.KafkaBrokers(t)
	pool := stack.Pool(t, stack.Database(t))
	_, err := pool.Exec(ctx, `ALTER SEQUENCE outbox_events_id_seq CACHE 20`)
	require.NoError(t, err)
	pub, err := outbox.NewPublisher(pool, outbox.Config{Brokers: brokers, Logger: testLogger()})
	require.NoError(t, err)
	runCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err = pub.Run(runCtx)
	require.ErrorIs(t, err, outbox.ErrIDSequenceCached)
	require.Contains(t, err.Error(), "CACHE 20")
	require.Contains(t, err.Error(), "ALTER SEQUENCE outbox_events_id_seq CACHE 1")
	var owned int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_shard_leases WHERE owner IS NOT NULL`).Scan(&owned))
	require.Zero(t, owned, "a refused publisher claims no shard")

	_, err = pool.Exec(ctx, `ALTER SEQUENCE outbox_events_id_seq CACHE 1`)
	require.NoError(t, err)
	pub = startPublisher(t, pool, outbox.Config{Brokers: brokers})
	waitFor(t, time.Minute, "the publisher to claim shards", func() bool {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_shard_leases WHERE owner = $1`, pub.ID()).Scan(&owned))
		return owned == outbox.NumShards
	})
}
