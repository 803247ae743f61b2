package outbox

import (
	"context"
	"fmt"
)

// unownedShardsSQL counts the shards nobody holds a live lease on. (Kept
// beside Ready rather than in sql.go: it is the readiness probe's only
// query.)
const unownedShardsSQL = `SELECT count(*) FROM outbox_shard_leases WHERE owner IS NULL OR expires_at IS NULL OR expires_at <= now()`

// Ready fails while this publisher holds no shard although some shard has
// no live owner: their events wait, and this publisher is not taking them
// (it has not joined yet, or its claims fail). A publisher that holds
// nothing because the others hold every shard is a ready standby.
func (p *Publisher) Ready(ctx context.Context) error {
	p.mu.Lock()
	held := len(p.workers)
	p.mu.Unlock()
	if held > 0 {
		return nil
	}
	var unowned int
	if err := p.pool.QueryRow(ctx, unownedShardsSQL).Scan(&unowned); err != nil {
		return fmt.Errorf("count unowned shards: %w", err)
	}
	if unowned > 0 {
		return fmt.Errorf("holds no shard while %d of %d shards have no live owner", unowned, NumShards)
	}
	return nil
}
