package sink

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"
)

// MoveAliases moves cfg's read alias (with its tombstone filter) and write
// alias to index in one _aliases call, recording where they came from in
// index's _meta for [Rollback]. It returns the indices the read alias left,
// or nil (and does nothing) when both already point at index. The caller
// checks that the move is safe (package reconcile's Cutover does).
//
// It moves the whole alias: with several jobs on the alias, whose
// documents the read alias finds in different generations (see
// [PlanMove]), use [PlanMove] and [ApplyMove] (package reconcile's Cutover
// and Rollback), which move one job's.
func MoveAliases(ctx context.Context, cfg Config, index string) ([]string, error) {
	cfg = cfg.withDefaults()
	client, err := NewClientWith(cfg.URL, cfg.HTTPClient)
	if err != nil {
		return nil, err
	}
	return moveAliases(ctx, client, cfg, index)
}

// GenerationExists reports whether index exists as a generation (with or
// without its _meta).
func GenerationExists(ctx context.Context, client *elastic.Client, index string) (bool, error) {
	gens, err := listGenerations(ctx, client, index)
	return len(gens) == 1, err
}

// Refresh makes everything written to index searchable.
func Refresh(ctx context.Context, client *elastic.Client, index string) error {
	return refresh(ctx, client, index)
}

// moveAliases moves both aliases to index in one call, recording where
// they came from in index's _meta. It returns nil (and does nothing) when
// both already point there.
func moveAliases(ctx context.Context, client *elastic.Client, cfg Config, index string) ([]string, error) {
	read, err := AliasTargets(ctx, client, cfg.Alias)
	if err != nil {
		return nil, err
	}
	write, err := AliasTargets(ctx, client, cfg.WriteAlias)
	if err != nil {
		return nil, err
	}
	gens, err := listGenerations(ctx, client, index)
	if err != nil {
		return nil, err
	}
	if len(gens) != 1 {
		return nil, fmt.Errorf("%w: index %s does not exist", ErrUnsafeMove, index)
	}
	meta := gens[0].Meta
	if meta.BulkLoad != nil {
		// Still in bulk-load mode (refresh off): searches would not see
		// what it holds, nor anything written to it later.
		if err := restoreSettings(ctx, client, index, *meta.BulkLoad); err != nil {
			return nil, err
		}
		meta.BulkLoad = nil
		if err := putMeta(ctx, client, index, meta); err != nil {
			return nil, err
		}
	}
	if slices.Equal(read, []string{index}) && slices.Equal(write, []string{index}) {
		return nil, nil
	}
	if len(read) == 1 && read[0] != index {
		if meta.PreviousUUID, err = indexUUID(ctx, client, read[0]); err != nil {
			return nil, err
		}
		meta.Previous = read[0]
	}
	meta.CutoverAt = time.Now().UTC().Format(time.RFC3339)
	if err := putMeta(ctx, client, index, meta); err != nil {
		return nil, err
	}
	if err := updateAliases(ctx, client, aliasMove(cfg.Alias, cfg.WriteAlias, read, write, index)); err != nil {
		return nil, fmt.Errorf("move aliases %s and %s to %s (someone else moved them meanwhile?): %w", cfg.Alias, cfg.WriteAlias, index, err)
	}
	if read == nil {
		read = []string{} // moved, from no index
	}
	return read, nil
}

// Rollback moves both aliases back to the generation they left when they
// last moved to the live one, in one _aliases call, without checks (package
// reconcile's Rollback checks the target first and moves one job's
// documents; indexer rollback uses that). It refuses while the read alias
// spans several generations. Rolling back twice
// rolls forward again. It refuses when there is no previous generation or
// it was dropped.
func Rollback(ctx context.Context, cfg Config) (from, into string, err error) {
	cfg = cfg.withDefaults()
	client, err := NewClientWith(cfg.URL, cfg.HTTPClient)
	if err != nil {
		return "", "", err
	}
	read, err := AliasTargets(ctx, client, cfg.Alias)
	if err != nil {
		return "", "", err
	}
	if len(read) != 1 {
		return "", "", fmt.Errorf("%w: read alias %s points at %v; want exactly one index", ErrUnsafeMove, cfg.Alias, read)
	}
	from = read[0]
	gens, err := listGenerations(ctx, client, from)
	if err != nil {
		return from, "", err
	}
	if len(gens) != 1 || gens[0].Meta.Previous == "" {
		return from, "", fmt.Errorf("%w: live generation %s records no previous generation to roll back to", ErrUnsafeMove, from)
	}
	into = gens[0].Meta.Previous
	prev, err := listGenerations(ctx, client, into)
	if err != nil {
		return from, into, err
	}
	if len(prev) != 1 {
		return from, into, fmt.Errorf("%w: previous generation %s of alias %s no longer exists (dropped)", ErrUnsafeMove, into, cfg.Alias)
	}
	if want := gens[0].Meta.PreviousUUID; want != "" {
		uuid, err := indexUUID(ctx, client, into)
		if err != nil {
			return from, into, err
		}
		if uuid != want {
			return from, into, fmt.Errorf("%w: previous generation %s of alias %s was dropped and created again since the cutover "+
				"(by an indexer that received an event of processor version %s): it holds only what arrived since (%d documents); "+
				"rebuild it (batcher run at that version, then indexer cutover --job) instead",
				ErrUnsafeMove, into, cfg.Alias, prev[0].Meta.ProcessorVersion, mustCount(ctx, client, into))
		}
	}
	if _, err := moveAliases(ctx, client, cfg, into); err != nil {
		return from, into, err
	}
	return from, into, nil
}

// DropGeneration deletes a generation index that neither alias points at.
// A generation is an index whose generation metadata names cfg's alias, or
// the index the indexer creates at its start (<alias>_v1, which has none
// until a v1 event adopts it); another index that merely shares the
// alias's prefix is not the indexer's to delete.
func DropGeneration(ctx context.Context, cfg Config, index string) error {
	cfg = cfg.withDefaults()
	client, err := NewClientWith(cfg.URL, cfg.HTTPClient)
	if err != nil {
		return err
	}
	gens, err := Generations(ctx, client, cfg.Alias, cfg.WriteAlias)
	if err != nil {
		return err
	}
	i := slices.IndexFunc(gens, func(g Generation) bool { return g.Index == index })
	if i < 0 {
		return fmt.Errorf("%w: %s is not a generation of alias %s", ErrUnsafeMove, index, cfg.Alias)
	}
	if g := gens[i]; g.Live || g.Writes {
		return fmt.Errorf("%w: %s is the live generation of alias %s (cut over or roll back first)", ErrUnsafeMove, index, cfg.Alias)
	}
	if g := gens[i]; g.Meta.Alias != cfg.Alias && index != cfg.Alias+"_v1" {
		return fmt.Errorf("%w: %s is not a generation of alias %s: its mapping has no generation metadata (_meta.%s), so no indexer created it for a processor version; "+
			"delete it with the engine's API if it is yours to delete", ErrUnsafeMove, index, cfg.Alias, metaKey)
	}
	_, err = client.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodDelete, Path: "/" + url.PathEscape(index)})
	if err != nil {
		return fmt.Errorf("delete index %s: %w", index, err)
	}
	return nil
}

// NormalizedRowsByPV counts normalized_records rows per processor version
// (all sources), for the progress of building generations in status.
func NormalizedRowsByPV(ctx context.Context, db *pgxpool.Pool) (map[string]int64, error) {
	rows, err := db.Query(ctx, `SELECT coalesce(processor_version, ''), count(*) FROM normalized_records GROUP BY 1`)
	if err != nil {
		return nil, fmt.Errorf("count normalized rows per processor version: %w", err)
	}
	out := map[string]int64{}
	for rows.Next() {
		var pv string
		var n int64
		if err := rows.Scan(&pv, &n); err != nil {
			rows.Close()
			return nil, err
		}
		out[pv] = n
	}
	return out, rows.Err()
}

// scanByPVSQL sums, per processor version, the partitions of each job's
// newest run at that version that has not finished.
const scanByPVSQL = `
WITH newest AS (
  SELECT DISTINCT ON (job, processor_version) job, processor_version, logical_run_id
  FROM batch_runs WHERE state <> 'superseded'
  ORDER BY job, processor_version, created_at DESC
)
SELECT r.processor_version, CASE WHEN count(DISTINCT (r.job, r.logical_run_id)) = 1 THEN min(r.logical_run_id) ELSE '' END,
       sum(r.processed_count)::bigint, CASE WHEN count(r.estimated_total) = count(*) THEN sum(r.estimated_total)::bigint END
FROM batch_runs r JOIN newest n USING (job, processor_version, logical_run_id)
WHERE r.state <> 'superseded'
  AND EXISTS (SELECT FROM batch_runs u WHERE u.job = r.job AND u.logical_run_id = r.logical_run_id AND u.state NOT IN ('succeeded', 'superseded'))
GROUP BY r.processor_version`

// ScanByPV reads the scan progress of the runs under way per processor
// version (see [Status].ScanByPV).
func ScanByPV(ctx context.Context, db *pgxpool.Pool) (map[string]RunScan, error) {
	rows, err := db.Query(ctx, scanByPVSQL)
	if err != nil {
		return nil, fmt.Errorf("read the progress of runs per processor version: %w", err)
	}
	defer rows.Close()
	out := map[string]RunScan{}
	for rows.Next() {
		var pv string
		var sc RunScan
		if err := rows.Scan(&pv, &sc.Run, &sc.Processed, &sc.Estimated); err != nil {
			return nil, err
		}
		out[pv] = sc
	}
	return out, rows.Err()
}

// mustCount counts index's documents for a message; -1 when it cannot.
func mustCount(ctx context.Context, client *elastic.Client, index string) int64 {
	n, err := countDocs(ctx, client, index, nil)
	if err != nil {
		return -1
	}
	return n
}
