package sink

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/olivere/elastic/v7"

	"github.com/outboxrelay/outboxrelay/index"
)

// ReindexOptions configure [Reindex].
type ReindexOptions struct {
	// Into is the new index, e.g. "records_v1_m2" (not a name of another
	// processor version's generation, "records_v2"). Required.
	Into string
	// Settle is how long to wait after moving the write alias before the
	// copy starts, so bulk requests that resolved the alias to the old
	// index just before the move have landed. An indexer gives a bulk
	// request up to its RequestTimeout (then retries it, through the moved
	// alias): a request it saw succeed was applied by then. Default
	// cfg.RequestTimeout + 5s; keep it above the running indexers'
	// REQUEST_TIMEOUT.
	Settle time.Duration
	// Poll is how often the copy task is polled. Default 1s.
	Poll time.Duration
}

// ReindexResult reports a finished rebuild.
type ReindexResult struct {
	From, Into               string
	Copied, Conflicts, Total int64
	Took                     time.Duration
}

// Reindex rebuilds the index behind cfg's aliases into a new index without
// downtime for searches:
//
//  1. create opts.Into from cfg.Mapping (a changed mapping is the usual
//     reason to rebuild);
//  2. move the write alias to it in one _aliases call: from now on every
//     indexer writes new events into the new index, while searches keep
//     reading the old one through the read alias;
//  3. copy the old index into the new one on the server (_reindex) with
//     version_type=external and conflicts=proceed, so each document keeps
//     its source version and a copy never overwrites a newer live write
//     (nor a newer tombstone: tombstones are documents and are copied too);
//  4. swap the read alias (with its tombstone filter) from the old index to
//     the new one in one _aliases call.
//
// It is safe to run again after a failure: every step is idempotent. The
// old index is kept; delete it when satisfied.
func Reindex(ctx context.Context, cfg Config, opts ReindexOptions) (ReindexResult, error) {
	cfg = cfg.withDefaults()
	opts.Settle = cmp.Or(opts.Settle, cfg.RequestTimeout+5*time.Second)
	opts.Poll = cmp.Or(opts.Poll, time.Second)
	res := ReindexResult{Into: opts.Into}
	start := time.Now()
	if opts.Into == "" {
		return res, &ConfigError{Err: fmt.Errorf("ReindexOptions.Into is required (the new index, e.g. %s_v1_m2)", cfg.Alias)}
	}
	if opts.Into == cfg.Alias || opts.Into == cfg.WriteAlias {
		return res, &ConfigError{Err: fmt.Errorf("ReindexOptions.Into=%q: must not be an alias name", opts.Into)}
	}
	client, err := index.NewClientWith(cfg.URL, cfg.HTTPClient)
	if err != nil {
		return res, err
	}
	log := cfg.Logger
	reads, err := index.AliasTargets(ctx, client, cfg.Alias)
	if err != nil {
		return res, err
	}
	if len(reads) != 1 {
		return res, fmt.Errorf("read alias %s points at %v; want exactly one index", cfg.Alias, reads)
	}
	res.From = reads[0]
	if res.From == opts.Into {
		log.Info("read alias already points at the target; nothing to do", slog.String("index", opts.Into))
		return res, nil
	}
	writes, err := index.AliasTargets(ctx, client, cfg.WriteAlias)
	if err != nil {
		return res, err
	}

	// 1. The new index; it carries on the old one's generation (the same
	// processor version), and a rollback leads back to the old one.
	if err := index.Create(ctx, client, opts.Into, cfg.Mapping, nil); err != nil {
		return res, err
	}
	if gens, err := index.ListGenerations(ctx, client, res.From); err != nil {
		return res, err
	} else if len(gens) == 1 && gens[0].Meta.ProcessorVersion != "" {
		meta := gens[0].Meta
		meta.Previous, meta.CreatedAt = res.From, time.Now().UTC().Format(time.RFC3339)
		if err := index.PutMeta(ctx, client, opts.Into, meta); err != nil {
			return res, err
		}
	}
	genAliases, err := generationAliasesOf(ctx, client, res.From, cfg)
	if err != nil {
		return res, err
	}
	// 2. New writes go to the new index: the write alias and the
	// generation's own write alias (documents carrying its processor
	// version).
	if len(writes) != 1 || writes[0] != opts.Into || len(genAliases) > 0 {
		actions := []any{}
		for _, w := range writes {
			actions = append(actions, map[string]any{"remove": map[string]any{"index": w, "alias": cfg.WriteAlias}})
		}
		actions = append(actions, map[string]any{"add": map[string]any{"index": opts.Into, "alias": cfg.WriteAlias, "is_write_index": true}})
		for _, a := range genAliases {
			actions = append(actions,
				map[string]any{"remove": map[string]any{"index": res.From, "alias": a}},
				map[string]any{"add": map[string]any{"index": opts.Into, "alias": a, "is_write_index": true}})
		}
		if err := index.UpdateAliases(ctx, client, actions); err != nil {
			return res, err
		}
		log.Info("write alias moved", slog.String("alias", cfg.WriteAlias), slog.String("index", opts.Into))
		select {
		case <-time.After(opts.Settle):
		case <-ctx.Done():
			return res, ctx.Err()
		}
	}
	// 3. Copy, keeping external versions; the copy only sees refreshed
	// documents, hence the refresh.
	if err := index.Refresh(ctx, client, res.From); err != nil {
		return res, err
	}
	task, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method: http.MethodPost,
		Path:   "/_reindex",
		Params: url.Values{"wait_for_completion": {"false"}, "refresh": {"true"}},
		Body: map[string]any{
			"conflicts": "proceed",
			"source":    map[string]any{"index": res.From, "size": 1000},
			"dest":      map[string]any{"index": opts.Into, "version_type": "external"},
		},
	})
	if err != nil {
		return res, fmt.Errorf("start _reindex %s -> %s: %w", res.From, opts.Into, err)
	}
	var started struct {
		Task string `json:"task"`
	}
	if err := json.Unmarshal(task.Body, &started); err != nil || started.Task == "" {
		return res, fmt.Errorf("start _reindex: unexpected answer %s", task.Body)
	}
	log.Info("copying", slog.String("from", res.From), slog.String("into", opts.Into), slog.String("task", started.Task))
	tick := time.NewTicker(opts.Poll)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
		case <-ctx.Done():
			return res, ctx.Err()
		}
		r, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodGet, Path: "/_tasks/" + url.PathEscape(started.Task)})
		if err != nil {
			if index.IsRetryable(err) {
				log.Warn("polling the copy task failed; retrying", slog.String("error", err.Error()))
				continue
			}
			return res, fmt.Errorf("poll _reindex task %s: %w", started.Task, err)
		}
		var t struct {
			Completed bool `json:"completed"`
			Task      struct {
				Status struct {
					Total            int64 `json:"total"`
					Created          int64 `json:"created"`
					Updated          int64 `json:"updated"`
					VersionConflicts int64 `json:"version_conflicts"`
				} `json:"status"`
			} `json:"task"`
			Error    json.RawMessage `json:"error"`
			Response struct {
				Failures []json.RawMessage `json:"failures"`
			} `json:"response"`
		}
		if err := json.Unmarshal(r.Body, &t); err != nil {
			return res, fmt.Errorf("decode _reindex task: %w", err)
		}
		s := t.Task.Status
		res.Copied, res.Conflicts, res.Total = s.Created+s.Updated, s.VersionConflicts, s.Total
		if !t.Completed {
			log.Info("copy progress", slog.Int64("done", s.Created+s.Updated+s.VersionConflicts), slog.Int64("total", s.Total))
			continue
		}
		if len(t.Error) > 0 && string(t.Error) != "null" {
			return res, fmt.Errorf("_reindex %s -> %s failed: %s", res.From, opts.Into, t.Error)
		}
		if len(t.Response.Failures) > 0 {
			return res, fmt.Errorf("_reindex %s -> %s: %d failure(s), first: %s", res.From, opts.Into, len(t.Response.Failures), t.Response.Failures[0])
		}
		break
	}
	// 4. Searches move to the new index, atomically.
	if err := index.UpdateAliases(ctx, client, []any{
		map[string]any{"remove": map[string]any{"index": res.From, "alias": cfg.Alias}},
		map[string]any{"add": map[string]any{"index": opts.Into, "alias": cfg.Alias, "filter": index.NotDeletedFilter()}},
	}); err != nil {
		return res, err
	}
	res.Took = time.Since(start)
	log.Info("read alias swapped", slog.String("alias", cfg.Alias), slog.String("from", res.From), slog.String("into", opts.Into),
		slog.Int64("copied", res.Copied), slog.Int64("conflicts", res.Conflicts), slog.Duration("took", res.Took))
	return res, nil
}

// generationAliasesOf returns the generation write aliases on index: its
// "-write" aliases other than cfg's.
func generationAliasesOf(ctx context.Context, client *elastic.Client, index string, cfg Config) ([]string, error) {
	r, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodGet, Path: "/" + url.PathEscape(index) + "/_alias"})
	if err != nil {
		return nil, fmt.Errorf("read aliases of %s: %w", index, err)
	}
	var body map[string]struct {
		Aliases map[string]json.RawMessage `json:"aliases"`
	}
	if err := json.Unmarshal(r.Body, &body); err != nil {
		return nil, fmt.Errorf("decode aliases of %s: %w", index, err)
	}
	var out []string
	for name := range body[index].Aliases {
		if name != cfg.Alias && name != cfg.WriteAlias && strings.HasSuffix(name, "-write") {
			out = append(out, name)
		}
	}
	return out, nil
}
