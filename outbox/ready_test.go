package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// Ready fails while a publisher holds no shard and some shard has no live
// owner, is a ready standby when others hold every shard, and holds once it
// has taken shards.
func TestPublisherReadyMeansItHoldsShards(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	brokers := stack.KafkaBrokers(t)

	idle, err := outbox.NewPublisher(pool, outbox.Config{Brokers: brokers, Logger: testLogger()})
	require.NoError(t, err)
	require.EqualError(t, idle.Ready(ctx), "holds no shard while 64 of 64 shards have no live owner")

	// Someone else holds every shard: nothing waits on this one.
	_, err = pool.Exec(ctx, `UPDATE outbox_shard_leases SET owner = 'other', expires_at = now() + interval '1 hour'`)
	require.NoError(t, err)
	require.NoError(t, idle.Ready(ctx))

	// Their leases expire: the shards wait again.
	_, err = pool.Exec(ctx, `UPDATE outbox_shard_leases SET expires_at = now() - interval '1 second' WHERE shard < 5`)
	require.NoError(t, err)
	require.EqualError(t, idle.Ready(ctx), "holds no shard while 5 of 64 shards have no live owner")

	// A running publisher takes them and is ready.
	_, err = pool.Exec(ctx, `UPDATE outbox_shard_leases SET owner = NULL, expires_at = NULL`)
	require.NoError(t, err)
	running := startPublisher(t, pool, outbox.Config{Brokers: brokers})
	waitFor(t, time.Minute, "the running publisher ready", func() bool { return running.Ready(ctx) == nil })
	// The idle one now sees every shard owned: a standby.
	require.NoError(t, idle.Ready(ctx))
}
