package sink

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/olivere/elastic/v7"
)

// A generation is created in bulk-load mode: refresh off
// (index.refresh_interval -1) and no replicas (index.number_of_replicas 0),
// the settings a search engine indexes fastest with, because nothing
// searches a generation being built (a rebuild) or wants its half-filled
// state refreshed every second (a first fill). The settings the mapping
// asked for are kept in the generation's _meta (GenerationMeta.BulkLoad)
// and restored, followed by a refresh, by finishBulkLoad:
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
// topic goes quiet) and a test of its own.

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

// finishBulkLoad restores the settings of a generation in bulk-load mode,
// refreshes it, and then clears the mode from its _meta (in that order: a
// crash in between leaves the mode recorded, and the next call restores
// again). It does nothing when index is not in bulk-load mode.
func finishBulkLoad(ctx context.Context, client *elastic.Client, index string) error {
	gens, err := listGenerations(ctx, client, index)
	if err != nil || len(gens) != 1 || gens[0].Meta.BulkLoad == nil {
		return err
	}
	if err := restoreSettings(ctx, client, index, *gens[0].Meta.BulkLoad); err != nil {
		return err
	}
	meta := gens[0].Meta
	meta.BulkLoad = nil
	return putMeta(ctx, client, index, meta)
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
	return refresh(ctx, client, index)
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
	n, err := countDocs(ctx, client, index, nil)
	if err != nil || n > 0 {
		return nil, err
	}
	s, err := bulkLoadSettings(ctx, client, index)
	if err != nil {
		return nil, err
	}
	return &s, nil
}

// bulkLoadSettings reads index's refresh interval and replica count as the
// engine has them now ("" when not set on the index).
func bulkLoadSettings(ctx context.Context, client *elastic.Client, index string) (BulkLoad, error) {
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

// caughtUp reports whether the batch brought every partition it holds to
// within one batch (slack messages) of the partition's high watermark when
// its last message was fetched. Not "at the high watermark": under a steady
// stream a full batch often ends partway through one of its partitions, and
// a first generation would stay unrefreshed, so unsearchable, for as long as
// the stream lasted.
func caughtUp(docs []*doc, slack int) bool {
	last := map[int]*doc{}
	for _, d := range docs {
		last[d.msg.Partition] = d
	}
	for _, d := range last {
		if d.msg.HighWaterMark-(d.msg.Offset+1) >= int64(slack) {
			return false
		}
	}
	return len(last) > 0
}

// finishBulkLoads takes every generation this router found in bulk-load
// mode out of it, once a batch reached the end of its partitions. A failure
// is logged and tried again after the next such batch.
func (r *router) finishBulkLoads(ctx context.Context, docs []*doc) {
	r.mu.Lock()
	pending := make([]string, 0, len(r.bulk))
	for index := range r.bulk {
		pending = append(pending, index)
	}
	r.mu.Unlock()
	if len(pending) == 0 || !caughtUp(docs, r.slack) {
		return
	}
	for _, index := range pending {
		b := backoff.WithContext(backoff.WithMaxRetries(backoff.NewExponentialBackOff(backoff.WithInitialInterval(200*time.Millisecond)), 3), ctx)
		err := backoff.Retry(func() error {
			err := finishBulkLoad(ctx, r.client, index)
			if err != nil && !IsRetryable(err) {
				return backoff.Permanent(err)
			}
			return err
		}, b)
		if err != nil {
			r.log.Warn("could not end the bulk load of an index generation (tried again after the next batch that catches up)",
				slog.String("index", index), slog.Any("error", err))
			continue
		}
		r.log.Info("index generation caught up: refresh and replicas restored", slog.String("index", index))
		r.mu.Lock()
		delete(r.bulk, index)
		r.mu.Unlock()
	}
}
