package index

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"

	"github.com/olivere/elastic/v7"
)

// A generation is created in bulk-load mode: refresh off
// (index.refresh_interval -1) and no replicas (index.number_of_replicas 0),
// the settings a search engine indexes fastest with, because nothing
// searches a generation being built (a rebuild) or wants its half-filled
// state refreshed every second (a first fill). The settings the mapping
// asked for are kept in the generation's _meta (GenerationMeta.BulkLoad)
// and restored, followed by a refresh, by FinishBulkLoad:
//
//   - by the indexer once the load into the generation is over: it has
//     caught up with its partitions (each within one batch of its end)
//     and the load has stopped (less than one batch fetched in the last
//     second: the topic went quiet or carries a live trickle), or it has
//     caught up and BULK_LOAD_MAX (default 5m) has passed since it first
//     found the generation in the mode (a stream that does not stop).
//     With BULK_LOAD_MAX=0, at the first batch that catches up. An
//     indexer that restarts reads the mode from the _meta again (see
//     package sink's bulkload.go); and
//   - by every alias move to the generation (cutover, rollback), before the
//     aliases move, so no cutover makes a generation live that is not
//     refreshed or that would not refresh.
//
// Documents of a generation in bulk-load mode become searchable when it
// leaves the mode: in a first fill, about a second after the load stops,
// or after BULK_LOAD_MAX.
//
// Caught up alone is not the end of a load: in a first fill the indexer
// keeps up with the batcher from the first events it receives, and ending
// the mode there (the rule before BULK_LOAD_MAX) indexed the whole load
// with a 1 s refresh, many small segments and their merges. Since no batch
// arrives when the topic goes quiet, the indexer also checks on a timer
// (every 250 ms while a generation is in the mode). The gain has not been
// measured yet: bench-e2e ran with the old rule, and showed none beyond
// its run-to-run noise then.
//
// Known limits: each indexer judges by its own partitions, so with several
// indexers the first whose share of the load is over ends the mode for
// all; and an indexer finds a generation in the mode only when a document
// for it arrives, so one left in the mode by an indexer that stopped for
// good stays in it until a document for it arrives, or a cutover.

// BulkLoad is what a generation in bulk-load mode restores: the values its
// mapping asked for ("" = the engine's default).
type BulkLoad struct {
	RefreshInterval string `json:"refresh_interval,omitempty"`
	Replicas        string `json:"number_of_replicas,omitempty"`
}

// withBulkLoad returns the create-index body with the bulk-load settings in
// place of the mapping's own, and what to restore later.
func withBulkLoad(body map[string]any) *BulkLoad {
	settings, _ := body["settings"].(map[string]any)
	if settings == nil {
		settings = map[string]any{}
		body["settings"] = settings
	}
	restore := &BulkLoad{}
	// Settings may be nested under "index" or flat, with or without the
	// "index." prefix: take (and remove) each spelling.
	take := func(name string) string {
		var v any
		if idx, ok := settings["index"].(map[string]any); ok {
			if x, ok := idx[name]; ok {
				v = x
				delete(idx, name)
			}
		}
		for _, k := range []string{name, "index." + name} {
			if x, ok := settings[k]; ok {
				v = x
				delete(settings, k)
			}
		}
		if v == nil {
			return ""
		}
		return fmt.Sprint(v)
	}
	restore.RefreshInterval = take("refresh_interval")
	restore.Replicas = take("number_of_replicas")
	settings["index.refresh_interval"] = "-1"
	settings["index.number_of_replicas"] = 0
	return restore
}

// FinishBulkLoad restores the settings of a generation in bulk-load mode,
// refreshes it, and then clears the mode from its _meta (in that order: a
// crash in between leaves the mode recorded, and the next call restores
// again). It does nothing when index is not in bulk-load mode.
func FinishBulkLoad(ctx context.Context, client *elastic.Client, index string) error {
	gens, err := ListGenerations(ctx, client, index)
	if err != nil || len(gens) != 1 || gens[0].Meta.BulkLoad == nil {
		return err
	}
	if err := restoreSettings(ctx, client, index, *gens[0].Meta.BulkLoad); err != nil {
		return err
	}
	meta := gens[0].Meta
	meta.BulkLoad = nil
	return PutMeta(ctx, client, index, meta)
}

// restoreSettings puts back what bulk-load mode replaced (null: the
// engine's default) and refreshes index.
func restoreSettings(ctx context.Context, client *elastic.Client, index string, bl BulkLoad) error {
	val := func(s string) any {
		if s == "" {
			return nil
		}
		return s
	}
	err := putSettings(ctx, client, index, map[string]any{"refresh_interval": val(bl.RefreshInterval), "number_of_replicas": val(bl.Replicas)})
	if err != nil {
		return fmt.Errorf("restore index.refresh_interval=%q and index.number_of_replicas=%q after the bulk load: %w",
			bl.RefreshInterval, bl.Replicas, err)
	}
	return Refresh(ctx, client, index)
}

// putSettings updates index's dynamic index settings.
func putSettings(ctx context.Context, client *elastic.Client, index string, settings map[string]any) error {
	_, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method: http.MethodPut,
		Path:   "/" + url.PathEscape(index) + "/_settings",
		Body:   map[string]any{"index": settings},
	})
	if err != nil {
		return fmt.Errorf("update settings of %s: %w", index, err)
	}
	return nil
}

// adoptBulkLoad returns what to restore when the existing index is put into
// bulk-load mode: its settings now, or nil (no bulk load) when it already
// holds documents that searches may be finding.
func adoptBulkLoad(ctx context.Context, client *elastic.Client, index string) (*BulkLoad, error) {
	n, err := CountDocs(ctx, client, index, nil)
	if err != nil || n > 0 {
		return nil, err
	}
	s, err := BulkLoadSettings(ctx, client, index)
	if err != nil {
		return nil, err
	}
	return &s, nil
}

// BulkLoadSettings reads index's refresh interval and replica count as the
// engine has them now ("" when not set on the index).
func BulkLoadSettings(ctx context.Context, client *elastic.Client, index string) (BulkLoad, error) {
	res, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method: http.MethodGet,
		Path:   "/" + url.PathEscape(index) + "/_settings/index.refresh_interval,index.number_of_replicas",
	})
	if err != nil {
		return BulkLoad{}, fmt.Errorf("read settings of %s: %w", index, err)
	}
	var body map[string]struct {
		Settings struct {
			Index BulkLoad `json:"index"`
		} `json:"settings"`
	}
	if err := json.Unmarshal(res.Body, &body); err != nil {
		return BulkLoad{}, fmt.Errorf("decode settings of %s: %w", index, err)
	}
	return body[index].Settings.Index, nil
}
