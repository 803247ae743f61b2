package sink

import (
	"context"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"
)

// EngineReady fails when the search engine does not answer or its cluster
// health is red (a primary shard is unassigned: writes to it fail). Yellow
// (replicas missing, as on a single node) is ready.
func (ix *Indexer) EngineReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, pingTimeout)
	defer cancel()
	h, err := ix.client.ClusterHealth().Do(ctx)
	if err != nil {
		return fmt.Errorf("cluster health: %w", err)
	}
	if h.Status == "red" {
		return fmt.Errorf("cluster %s is red: %d unassigned shards", h.ClusterName, h.UnassignedShards)
	}
	return nil
}

// GroupReady fails unless this indexer is a member of its consumer group:
// before it joined, after it left, while the broker does not answer. A
// member without partitions (more indexers than partitions) is a ready
// standby.
func (ix *Indexer) GroupReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, pingTimeout)
	defer cancel()
	c := &kafka.Client{Addr: kafka.TCP(ix.cfg.Brokers...), Timeout: pingTimeout, Transport: ix.cfg.kafkaTransport()}
	resp, err := c.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: []string{ix.cfg.Group}})
	if err != nil {
		return fmt.Errorf("describe group %s: %w", ix.cfg.Group, err)
	}
	if len(resp.Groups) != 1 {
		return fmt.Errorf("describe group %s: %d groups in the answer", ix.cfg.Group, len(resp.Groups))
	}
	g := resp.Groups[0]
	if g.Error != nil {
		return fmt.Errorf("describe group %s: %w", ix.cfg.Group, g.Error)
	}
	id := ix.clientID()
	for _, m := range g.Members {
		if m.ClientID == id {
			return nil
		}
	}
	return fmt.Errorf("not a member of group %s (client id %s; group state %s, %d members)", ix.cfg.Group, id, g.GroupState, len(g.Members))
}

// clientID names this Indexer's consumer to the broker, unique per
// Indexer, so GroupReady can find it among the group's members.
func (ix *Indexer) clientID() string {
	ix.idOnce.Do(func() {
		host, _ := os.Hostname()
		ix.id = fmt.Sprintf("outboxrelay-indexer-%s-%d-%d", host, os.Getpid(), time.Now().UnixNano())
	})
	return ix.id
}

// clientIdentity is the consumer's client id, made once (see clientID).
type clientIdentity struct {
	idOnce sync.Once
	id     string
}
