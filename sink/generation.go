package sink

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/olivere/elastic/v7"

	"github.com/outboxrelay/outboxrelay/index"
)

// routeTTL is how long the indexer trusts that a generation it ensured
// still exists; after it, the next document of that version checks again
// (and re-creates a generation dropped while its events still flow).
const routeTTL = 30 * time.Second

// router picks the alias each document is written through: for a document
// that carries a processor version, the write alias of its alias's
// generation for that version (created on first sight); otherwise the
// alias's write alias (the live generation), which parse already set.
type router struct {
	client  *elastic.Client
	rules   *recordRules
	mapping []byte
	log     *slog.Logger

	mu      sync.Mutex // held while a generation is ensured: rare, and lanes wait for it anyway
	ensured map[[2]string]time.Time
	bulk    map[string]bool // indices found in bulk-load mode, until finishBulkLoads ends it
	slack   int             // how far from a partition's end still counts as caught up (BatchSize)
}

func newRouter(client *elastic.Client, cfg Config, rules *recordRules) *router {
	return &router{client: client, rules: rules, mapping: cfg.Mapping, log: cfg.Logger, ensured: map[[2]string]time.Time{}, bulk: map[string]bool{}, slack: cfg.BatchSize}
}

// route sets the target of every document of a batch that carries a
// processor version.
func (r *router) route(ctx context.Context, docs []*doc) error {
	var last [2]string
	var target string
	for _, d := range docs {
		if d.pv == "" {
			continue
		}
		if key := [2]string{d.alias, d.pv}; key != last || target == "" {
			t, err := r.target(ctx, d.alias, d.pv)
			if err != nil {
				return err
			}
			last, target = key, t
		}
		d.target = target
	}
	return nil
}

func (r *router) target(ctx context.Context, alias, pv string) (string, error) {
	idx := index.GenerationIndex(alias, pv)
	key := [2]string{alias, pv}
	r.mu.Lock()
	defer r.mu.Unlock()
	if at, ok := r.ensured[key]; ok && time.Since(at) < routeTTL {
		return index.GenerationWriteAlias(idx), nil
	}
	// The alias may point at another index than the generation's name:
	// indexer reindex moves it along with the copy.
	targets, err := index.AliasTargets(ctx, r.client, index.GenerationWriteAlias(idx))
	if err != nil {
		return "", err
	}
	if len(targets) == 0 {
		if err := r.create(ctx, alias, r.rules.writeAliasOf(alias), pv); err != nil {
			return "", err
		}
		if targets, err = index.AliasTargets(ctx, r.client, index.GenerationWriteAlias(idx)); err != nil {
			return "", err
		}
	} else if _, seen := r.ensured[key]; !seen {
		// Created before, by this process, another indexer or one killed
		// since, whose move of the aliases may have failed: the first
		// generation must still take them over (TakeOver does nothing
		// unless they point at the empty bootstrap index).
		if err := index.TakeOver(ctx, r.client, r.log, alias, r.rules.writeAliasOf(alias), idx); err != nil {
			return "", err
		}
	}
	// Another indexer (or this one before a restart) may have created it
	// in bulk-load mode: this one ends the mode too when it catches up.
	for _, t := range targets {
		bulk, err := index.InBulkLoad(ctx, r.client, t)
		if err != nil {
			return "", err
		}
		if bulk {
			r.bulk[t] = true
		}
	}
	r.ensured[key] = time.Now()
	return index.GenerationWriteAlias(idx), nil
}

// create creates pv's generation. The first generation ever takes the
// aliases over from the empty index the indexer created at its start when
// that index belongs to no processor version; otherwise the new
// generation builds beside the live one until a cutover (see
// [index.TakeOver]).
func (r *router) create(ctx context.Context, alias, writeAlias, pv string) error {
	idx, err := index.CreateGeneration(ctx, r.client, alias, pv, r.mapping, nil, true)
	if err != nil {
		return err
	}
	r.log.Info("index generation ready", slog.String("alias", alias), slog.String("processor_version", pv), slog.String("index", idx))
	return index.TakeOver(ctx, r.client, r.log, alias, writeAlias, idx)
}
