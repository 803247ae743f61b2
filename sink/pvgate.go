package sink

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/olivere/elastic/v7"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// Dead-letter codes of records whose processor version the indexer does
// not build a generation for.
const (
	// CodeUnknownProcessorVersion: the header ce_processorversion names a
	// version no job registered (Config.RegisteredVersions) and
	// Config.ProcessorVersions does not list. No index is created.
	CodeUnknownProcessorVersion = "unknown_processor_version"
	// CodeGenerationConflict: the index (or write alias) the record's
	// alias and processor version name belongs to another alias or
	// version, or is an index without generation metadata that is not the
	// alias's bootstrap index (<alias>_v1): nothing is written into it.
	CodeGenerationConflict = "generation_conflict"
)

// pvGate decides, before a batch is sent, which records carrying a
// processor version may be written: their version must be known (when
// the deployment says which are), and the generation index their alias
// and version name must be theirs (its _meta) or not exist yet. The others
// are dead-lettered, so an arbitrary header can neither create an index
// nor write into another alias's.
type pvGate struct {
	client *elastic.Client
	log    *slog.Logger
	// listed are Config.ProcessorVersions; source is
	// Config.RegisteredVersions. Neither set: every version is known.
	listed map[string]bool
	source func(ctx context.Context) ([]string, error)

	mu       sync.Mutex
	known    map[string]bool         // from source, as of loadedAt
	loadedAt time.Time               // when the last successful load started
	owned    map[[2]string]time.Time // (alias, pv) whose generation checked out, and when
}

// gateRefreshAttempts bounds how often a failing read of the registered
// versions is tried for one batch.
const gateRefreshAttempts = 3

func newPVGate(client *elastic.Client, cfg Config) *pvGate {
	g := &pvGate{client: client, log: cfg.Logger, source: cfg.RegisteredVersions, owned: map[[2]string]time.Time{}}
	if len(cfg.ProcessorVersions) > 0 {
		g.listed = map[string]bool{}
		for _, pv := range cfg.ProcessorVersions {
			g.listed[pv] = true
		}
	}
	return g
}

// check marks the records of docs that must not be written as poison.
func (g *pvGate) check(ctx context.Context, docs []*doc) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, d := range docs {
		if d.pv == "" || d.poison != nil || d.skip != "" {
			continue
		}
		ok, err := g.knownVersion(ctx, d)
		if err != nil {
			return err
		}
		if !ok {
			d.poison = &itemError{Code: CodeUnknownProcessorVersion, Reason: fmt.Sprintf(
				"header %s=%q: no job registered this processor version (batch_processor_versions) and PROCESSOR_VERSIONS does not list it; no index generation is created for it",
				outbox.HeaderProcessorVersion, d.pv)}
			continue
		}
		problem, err := g.ownGeneration(ctx, d.alias, d.pv)
		if err != nil {
			return err
		}
		if problem != "" {
			d.poison = &itemError{Code: CodeGenerationConflict, Reason: problem}
		}
	}
	return nil
}

// knownVersion reports whether d's processor version may have a
// generation. A job registers its version before any event of it is
// enqueued, so a version unknown as of a load that started before d was
// fetched is read again once, and unknown after that is unknown.
func (g *pvGate) knownVersion(ctx context.Context, d *doc) (bool, error) {
	if g.listed == nil && g.source == nil {
		return true, nil
	}
	if g.listed[d.pv] || g.known[d.pv] {
		return true, nil
	}
	if g.source == nil || (!g.loadedAt.IsZero() && g.loadedAt.After(d.fetched)) {
		return false, nil
	}
	var err error
	for attempt := 1; attempt <= gateRefreshAttempts; attempt++ {
		start := time.Now()
		var pvs []string
		if pvs, err = g.source(ctx); err == nil {
			g.known = map[string]bool{}
			for _, pv := range pvs {
				g.known[pv] = true
			}
			g.loadedAt = start
			return g.known[d.pv], nil
		}
		g.log.Warn("read the registered processor versions", slog.Int("attempt", attempt), slog.String("error", err.Error()))
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case <-time.After(time.Duration(attempt) * time.Second):
		}
	}
	return false, fmt.Errorf("read the registered processor versions (header %s=%q is not known yet): %w", outbox.HeaderProcessorVersion, d.pv, err)
}

// ownGeneration says why the generation of (alias, pv) must not be
// written, or "" when it may: the index its write alias points at (or,
// without one, the index GenerationIndex names) does not exist, or its
// _meta names alias and pv, or it is alias's bootstrap index <alias>_v1
// without _meta, which a v1 event adopts. A good answer is trusted for
// routeTTL.
func (g *pvGate) ownGeneration(ctx context.Context, alias, pv string) (string, error) {
	key := [2]string{alias, pv}
	if at, ok := g.owned[key]; ok && time.Since(at) < routeTTL {
		return "", nil
	}
	idx := index.GenerationIndex(alias, pv)
	targets, err := index.AliasTargets(ctx, g.client, index.GenerationWriteAlias(idx))
	if err != nil {
		return "", err
	}
	if len(targets) == 0 {
		targets = []string{idx}
	}
	for _, t := range targets {
		gens, err := index.ListGenerations(ctx, g.client, t)
		if err != nil {
			return "", err
		}
		if problem := index.GenerationOwner(gens, alias, pv, t); problem != "" {
			return problem, nil
		}
	}
	g.owned[key] = time.Now()
	return "", nil
}
