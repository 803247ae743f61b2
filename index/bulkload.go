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
//   - by the indexer when a batch it resolved brought its partitions to
//     within one batch of their end (the generation has caught up with
//     what was produced; an indexer that restarts reads the mode from the
//     _meta again), and
//   - by every alias move to the generation (cutover, rollback), before the
//     aliases move, so no cutover makes a generation live that is not
//     refreshed or that would not refresh.
//
// Documents of a generation in bulk-load mode become searchable when it
// leaves the mode.
//
// Known limit: in a first fill the indexer is often caught up with the
// first events it receives (it waits for them), and so ends the mode in
// the first second; the mode then only helps the rebuilds and fills where
// the indexer is behind from the start. bench-e2e did not show a gain
// beyond its run-to-run noise. Ending it on "caught up and quiet for a
// while, or caught up after the mode has lasted a minimum" would keep it
// longer; that needs a timer outside the lanes (no batch arrives when the
// topic goes quiet) and a test of its own. It was built once and
// measured (bench-e2e, 1,000,000 rows, 2026-12-04): refresh off through
// the whole fill saved the search engine at most 4% of its CPU, inside the
// run-to-run spread, while nothing of the fill was searchable until it
// ended; it was reverted.

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
