package sink

import (
	"cmp"
	"context"
	"log/slog"
	"time"

	"github.com/outboxrelay/outboxrelay/index"
)

// States of an index generation, as `indexer status` and the
// indexer_generation_docs gauge name them.
const (
	stateLive     = "live"
	stateBuilding = "building"
	stateOld      = "old"
)

// generationStates returns the state of each of gs: live where the read
// alias points, building when created after the live one (or when none is
// live), old otherwise (kept for rollback).
func generationStates(gs []index.Generation) []string {
	var live *index.Generation
	for i := range gs {
		if gs[i].Live {
			live = &gs[i]
		}
	}
	out := make([]string, len(gs))
	for i, g := range gs {
		switch {
		case g.Live:
			out[i] = stateLive
		case live == nil || g.CreatedAt().After(live.CreatedAt()):
			out[i] = stateBuilding
		default:
			out[i] = stateOld
		}
	}
	return out
}

// generationRefresh is how often watchGenerations reads the generations.
const generationRefresh = 30 * time.Second

// watchGenerations keeps indexer_generation_docs current until ctx ends:
// every generation of every alias the indexer writes, with its document
// count and state. A rebuild's progress is its building generation's count
// rising; alert IndexRebuildStuck fires when it stops. An alias whose
// generations cannot be read keeps its last values (and a warning is
// logged); a generation that is gone disappears.
func (ix *Indexer) watchGenerations(ctx context.Context) {
	tick := time.NewTicker(cmp.Or(ix.genRefresh, generationRefresh))
	defer tick.Stop()
	exported := map[[3]string]bool{} // alias, index, state
	for {
		for _, alias := range ix.rules.aliases() {
			gs, err := index.Generations(ctx, ix.client, alias, ix.rules.writeAliasOf(alias))
			if err != nil {
				if ctx.Err() == nil {
					ix.log.Warn("cannot read the index generations", slog.String("alias", alias), slog.String("error", err.Error()))
				}
				continue
			}
			now := map[[3]string]bool{}
			for i, state := range generationStates(gs) {
				ix.m.generationDocs.WithLabelValues(alias, gs[i].Index, state).Set(float64(gs[i].Docs))
				now[[3]string{alias, gs[i].Index, state}] = true
			}
			// Set first, then drop what is gone (a dropped generation, or
			// one whose state changed at a cutover): a scrape between
			// never misses a generation.
			for k := range exported {
				if k[0] == alias && !now[k] {
					ix.m.generationDocs.DeleteLabelValues(k[0], k[1], k[2])
					delete(exported, k)
				}
			}
			for k := range now {
				exported[k] = true
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}
