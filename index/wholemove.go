package index

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"time"

	"github.com/olivere/elastic/v7"
)

// MoveAliases moves alias (the read alias, with its tombstone filter) and
// writeAlias to index in one _aliases call, recording where they came from
// in index's _meta for [Rollback]. It returns the indices the read alias
// left, or nil (and does nothing) when both already point at index. The
// caller checks that the move is safe (package reconcile's Cutover does).
//
// It moves the whole alias: with several jobs on the alias, whose
// documents the read alias finds in different generations (see
// [PlanMove]), use [MoveJob] (package reconcile's Cutover and Rollback),
// which moves one job's.
func MoveAliases(ctx context.Context, client *elastic.Client, alias, writeAlias, index string) ([]string, error) {
	read, err := AliasTargets(ctx, client, alias)
	if err != nil {
		return nil, err
	}
	write, err := AliasTargets(ctx, client, writeAlias)
	if err != nil {
		return nil, err
	}
	gens, err := ListGenerations(ctx, client, index)
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
		if err := PutMeta(ctx, client, index, meta); err != nil {
			return nil, err
		}
	}
	if slices.Equal(read, []string{index}) && slices.Equal(write, []string{index}) {
		return nil, nil
	}
	if len(read) == 1 && read[0] != index {
		if meta.PreviousUUID, err = UUID(ctx, client, read[0]); err != nil {
			return nil, err
		}
		meta.Previous = read[0]
	}
	meta.CutoverAt = time.Now().UTC().Format(time.RFC3339)
	if err := PutMeta(ctx, client, index, meta); err != nil {
		return nil, err
	}
	if err := UpdateAliases(ctx, client, aliasMove(alias, writeAlias, read, write, index)); err != nil {
		return nil, fmt.Errorf("move aliases %s and %s to %s (someone else moved them meanwhile?): %w", alias, writeAlias, index, err)
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
func Rollback(ctx context.Context, client *elastic.Client, alias, writeAlias string) (from, into string, err error) {
	read, err := AliasTargets(ctx, client, alias)
	if err != nil {
		return "", "", err
	}
	if len(read) != 1 {
		return "", "", fmt.Errorf("%w: read alias %s points at %v; want exactly one index", ErrUnsafeMove, alias, read)
	}
	from = read[0]
	gens, err := ListGenerations(ctx, client, from)
	if err != nil {
		return from, "", err
	}
	if len(gens) != 1 || gens[0].Meta.Previous == "" {
		return from, "", fmt.Errorf("%w: live generation %s records no previous generation to roll back to", ErrUnsafeMove, from)
	}
	into = gens[0].Meta.Previous
	prev, err := ListGenerations(ctx, client, into)
	if err != nil {
		return from, into, err
	}
	if len(prev) != 1 {
		return from, into, fmt.Errorf("%w: previous generation %s of alias %s no longer exists (dropped)", ErrUnsafeMove, into, alias)
	}
	if want := gens[0].Meta.PreviousUUID; want != "" {
		uuid, err := UUID(ctx, client, into)
		if err != nil {
			return from, into, err
		}
		if uuid != want {
			return from, into, fmt.Errorf("%w: previous generation %s of alias %s was dropped and created again since the cutover "+
				"(by an indexer that received an event of processor version %s): it holds only what arrived since (%d documents); "+
				"rebuild it (batcher run at that version, then indexer cutover --job) instead",
				ErrUnsafeMove, into, alias, prev[0].Meta.ProcessorVersion, mustCount(ctx, client, into))
		}
	}
	if _, err := MoveAliases(ctx, client, alias, writeAlias, into); err != nil {
		return from, into, err
	}
	return from, into, nil
}

// Drop deletes a generation index that neither alias points at.
// A generation is an index whose generation metadata names alias, or
// the index the indexer creates at its start (<alias>_v1, which has none
// until a v1 event adopts it); another index that merely shares the
// alias's prefix is not the indexer's to delete.
func Drop(ctx context.Context, client *elastic.Client, alias, writeAlias, index string) error {
	gens, err := Generations(ctx, client, alias, writeAlias)
	if err != nil {
		return err
	}
	i := slices.IndexFunc(gens, func(g Generation) bool { return g.Index == index })
	if i < 0 {
		return fmt.Errorf("%w: %s is not a generation of alias %s", ErrUnsafeMove, index, alias)
	}
	if g := gens[i]; g.Live || g.Writes {
		return fmt.Errorf("%w: %s is the live generation of alias %s (cut over or roll back first)", ErrUnsafeMove, index, alias)
	}
	if g := gens[i]; g.Meta.Alias != alias && index != alias+"_v1" {
		return fmt.Errorf("%w: %s is not a generation of alias %s: its mapping has no generation metadata (_meta.%s), so no indexer created it for a processor version; "+
			"delete it with the engine's API if it is yours to delete", ErrUnsafeMove, index, alias, metaKey)
	}
	_, err = client.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodDelete, Path: "/" + url.PathEscape(index)})
	if err != nil {
		return fmt.Errorf("delete index %s: %w", index, err)
	}
	return nil
}

// mustCount counts index's documents for a message; -1 when it cannot.
func mustCount(ctx context.Context, client *elastic.Client, index string) int64 {
	n, err := CountDocs(ctx, client, index, nil)
	if err != nil {
		return -1
	}
	return n
}
