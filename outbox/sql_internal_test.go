package outbox

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// The delete of a published batch removes exactly the ids sent, and only
// while the shard's lease is held with the worker's epoch; leaseHeldSQL, in
// the same round trip, tells the worker which it was. Read back over a new
// connection.
func TestDeletePublishedIsFencedByTheLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := stack.Database(t)
	pool := stack.Pool(t, url)
	_, err := pool.Exec(ctx, `
INSERT INTO outbox_events (event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload)
SELECT gen_random_uuid(), 't', 'a', 'k', g, 'upsert', '{}' FROM generate_series(1, 5) AS g`)
	require.NoError(t, err)
	var shard int
	require.NoError(t, pool.QueryRow(ctx, `SELECT outboxrelay_shard('k')`).Scan(&shard))
	rows, err := pool.Query(ctx, `SELECT id FROM outbox_events ORDER BY id`)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	require.Len(t, ids, 5)
	_, err = pool.Exec(ctx, `UPDATE outbox_shard_leases SET owner = 'b', epoch = 7, expires_at = now() + interval '1 minute' WHERE shard = $1`, shard)
	require.NoError(t, err)

	del := func(owner string, epoch int64, ids []int64) (deleted int64, held bool) {
		b := &pgx.Batch{}
		b.Queue(shardSQL[shard].delete, ids, shard, owner, epoch, ids[0], ids[len(ids)-1])
		b.Queue(leaseHeldSQL, shard, owner, epoch)
		br := pool.SendBatch(ctx, b)
		tag, err := br.Exec()
		require.NoError(t, err)
		require.NoError(t, br.QueryRow().Scan(&held))
		require.NoError(t, br.Close())
		return tag.RowsAffected(), held
	}
	left := func() []int64 {
		conn, err := pgx.Connect(ctx, url)
		require.NoError(t, err)
		defer conn.Close(ctx)
		rows, err := conn.Query(ctx, `SELECT id FROM outbox_events ORDER BY id`)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		require.NoError(t, err)
		return out
	}

	// A worker whose lease was taken over (an older epoch, or another
	// owner) deletes nothing and learns it.
	n, held := del("a", 6, ids[:3])
	require.Zero(t, n)
	require.False(t, held)
	n, held = del("b", 6, ids[:3])
	require.Zero(t, n)
	require.False(t, held)
	require.Equal(t, ids, left())

	// The holder deletes the ids it sent, not the ids between them.
	n, held = del("b", 7, []int64{ids[0], ids[2]})
	require.EqualValues(t, 2, n)
	require.True(t, held)
	require.Equal(t, []int64{ids[1], ids[3], ids[4]}, left())
}
