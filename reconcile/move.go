package reconcile

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"

	"github.com/outboxrelay/outboxrelay/internal/pgconn"
	"github.com/outboxrelay/outboxrelay/sink"
)

// A job's move (cutover, rollback, roll-forward) changes what searches find
// of that job only: see sink.PlanMove for the job-aware read alias. The
// steps, under the alias's advisory lock (the one AUTO_CUTOVER takes, so
// moves of one alias never interleave):
//
//  1. plan the one _aliases call from the alias as it is;
//  2. count the documents without a processor version (application
//     events) that the move takes out of searches and the target lacks (a
//     tombstone in the target counts as having it: the row was deleted);
//     refuse unless allowed;
//  3. wait for the target's health, record the move in its _meta, make the
//     call (sink.ApplyMove);
//  4. close the window between 2 and 3: documents without a processor
//     version written into the generation left between the count and the
//     call are copied into the target (at their external version).

// jobTypesOf returns the aggregate types of every job in batch_jobs whose
// documents go to alias under cfg's routes.
func jobTypesOf(ctx context.Context, db *pgxpool.Pool, cfg sink.Config, alias string) ([]string, error) {
	rows, err := db.Query(ctx, `SELECT spec FROM batch_jobs`)
	if err != nil {
		return nil, fmt.Errorf("list the jobs of alias %s: %w", alias, err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var j Job
		if err := rows.Scan(&j); err != nil {
			return nil, fmt.Errorf("list the jobs of alias %s: %w", alias, err)
		}
		typ := cmp.Or(j.AggregateType, j.Source.Table)
		if cfg.ForAggregateType(typ).Alias == alias {
			out = append(out, typ)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list the jobs of alias %s: %w", alias, err)
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// moveOptions configure moveJob.
type moveOptions struct {
	allowUnversioned bool
	healthTimeout    time.Duration
	// locked: the caller holds the alias's advisory lock already.
	locked     bool
	beforeMove func()
}

// moveResult is what moveJob did.
type moveResult struct {
	plan     sink.MovePlan
	hidden   int64 // documents without a processor version the move hid (allowed)
	copied   int64 // written into the generation left during the move, copied over
	already  bool
	fromList []string
}

// lockAlias takes alias's cutover lock on its own connection, waiting for
// it; the returned function lets go.
func lockAlias(ctx context.Context, db *pgxpool.Pool, alias string) (func(), error) {
	conn, err := db.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("take the cutover lock of alias %s: %w", alias, err)
	}
	key := cutoverLockKey(alias)
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, key); err != nil {
		conn.Release()
		return nil, fmt.Errorf("take the cutover lock of alias %s: %w", alias, err)
	}
	return func() {
		_ = pgconn.ReleaseAdvisoryLock(ctx, conn.Conn(), key)
		conn.Release()
	}, nil
}

// moveJob moves job j's documents (aggregate type) to target, in cfg's
// alias (cfg routed already). The caller ran the readiness checks.
func moveJob(ctx context.Context, cfg sink.Config, db *pgxpool.Pool, client *elastic.Client, j Job, target string, opts moveOptions) (moveResult, error) {
	var res moveResult
	if !opts.locked {
		unlock, err := lockAlias(ctx, db, cfg.Alias)
		if err != nil {
			return res, err
		}
		defer unlock()
	}
	types, err := jobTypesOf(ctx, db, cfg, cfg.Alias)
	if err != nil {
		return res, err
	}
	plan, err := sink.PlanMove(ctx, client, cfg.Alias, cfg.WriteAlias, sink.JobMove{Type: j.AggregateType, Target: target, JobTypes: types, HealthTimeout: opts.healthTimeout})
	res.plan = plan
	if err != nil {
		return res, err
	}
	if plan.Noop {
		res.already = true
		return res, sink.ApplyMove(ctx, client, plan) // ends a bulk load left over, nothing else
	}
	if plan.Leaving != "" {
		n, _, err := hiddenUnversioned(ctx, client, plan.Leaving, plan.LeavingQuery, target, false)
		if err != nil {
			return res, err
		}
		if n > 0 && !opts.allowUnversioned {
			return res, fmt.Errorf("%w: move of job %s to %s: %s holds %d document(s) without a processor version "+
				"(events enqueued by an application, not by a batcher job) that %s lacks; after the move searches would no longer find them. "+
				"Enqueue them again so they reach %s, or accept losing them from searches with --allow-unversioned",
				sink.ErrUnsafeMove, j.Name, target, plan.Leaving, n, target, target)
		}
		res.hidden = n
		if !plan.Whole && plan.Leaving == plan.OldBase {
			// The base keeps showing documents without an aggregate type:
			// some of them would now be found twice.
			dup, err := untypedTwice(ctx, client, plan.Leaving, target)
			if err != nil {
				return res, err
			}
			if dup > 0 {
				return res, fmt.Errorf("%w: move of job %s to %s: %s holds %d document(s) without %s (indexed before the indexer recorded it) whose ids %s holds too: "+
					"they would be found twice, since a move of one job of several keeps showing documents it cannot attribute. "+
					"Have them indexed again (indexer reconcile --job %s --repair at the live version) or remove them, then cut over",
					sink.ErrUnsafeMove, j.Name, target, plan.Leaving, dup, sink.FieldAggregateType, target, j.Name)
			}
		}
	}
	if opts.beforeMove != nil {
		opts.beforeMove()
	}
	if err := sink.ApplyMove(ctx, client, plan); err != nil {
		return res, err
	}
	res.fromList = []string{}
	if plan.From != "" {
		res.fromList = []string{plan.From}
	}
	if plan.Leaving != "" && !opts.allowUnversioned {
		// Written between the count and the call: copy them over.
		if err := sink.Refresh(ctx, client, plan.Leaving); err != nil {
			return res, err
		}
		n, ids, err := hiddenUnversioned(ctx, client, plan.Leaving, plan.LeavingQuery, target, true)
		if err != nil {
			return res, err
		}
		if n > 0 {
			if err := copyDocs(ctx, client, plan.Leaving, target, ids); err != nil {
				return res, err
			}
			res.copied = n
			cfg.Logger.Info("documents without a processor version written into the generation left during the move were copied to the new one",
				slog.String("from", plan.Leaving), slog.String("index", target), slog.Int64("documents", n))
		}
	}
	return res, nil
}

// hiddenUnversioned counts the documents of from that q selects and that
// carry no processor version whose id target lacks (any document of that
// id, a tombstone included, counts as having it: a row deleted during the
// rebuild is not an application document). With ids set it also returns
// them.
func hiddenUnversioned(ctx context.Context, client *elastic.Client, from string, q elastic.Query, target string, ids bool) (int64, []string, error) {
	sel := elastic.NewBoolQuery().Filter(q).MustNot(elastic.NewExistsQuery(sink.FieldPV))
	return scrollAbsent(ctx, client, from, sel, target, elastic.NewMatchAllQuery(), ids)
}

// untypedTwice counts the live documents of base without an aggregate type
// whose id target holds live.
func untypedTwice(ctx context.Context, client *elastic.Client, base, target string) (int64, error) {
	sel := elastic.NewBoolQuery().MustNot(elastic.NewExistsQuery(sink.FieldAggregateType), elastic.NewTermQuery(sink.FieldDeleted, true))
	var twice int64
	err := scrollPages(ctx, client, base, sel, func(page []string) error {
		found, err := client.Count(target).Query(elastic.NewBoolQuery().Filter(elastic.NewIdsQuery().Ids(page...)).
			MustNot(elastic.NewTermQuery(sink.FieldDeleted, true))).Do(ctx)
		twice += found
		return err
	})
	return twice, err
}

// scrollAbsent counts (and lists, with ids) the documents of from that sel
// selects whose id no document of target that in selects has.
func scrollAbsent(ctx context.Context, client *elastic.Client, from string, sel elastic.Query, target string, in elastic.Query, ids bool) (int64, []string, error) {
	var n int64
	var out []string
	err := scrollPages(ctx, client, from, sel, func(page []string) error {
		res, err := client.Search(target).Query(elastic.NewBoolQuery().Filter(elastic.NewIdsQuery().Ids(page...), in)).
			Size(len(page)).FetchSource(false).Do(ctx)
		if err != nil {
			return fmt.Errorf("look up documents in %s: %w", target, err)
		}
		have := map[string]bool{}
		for _, h := range res.Hits.Hits {
			have[h.Id] = true
		}
		for _, id := range page {
			if !have[id] {
				n++
				if ids {
					out = append(out, id)
				}
			}
		}
		return nil
	})
	return n, out, err
}

// scrollPages calls fn with the ids of each page of index's documents q
// selects.
func scrollPages(ctx context.Context, client *elastic.Client, index string, q elastic.Query, fn func([]string) error) error {
	scroll := client.Scroll(index).Query(q).Size(1000).FetchSource(false)
	defer func() { _ = scroll.Clear(context.WithoutCancel(ctx)) }()
	for {
		page, err := scroll.Do(ctx)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("list documents of %s: %w", index, err)
		}
		ids := make([]string, 0, len(page.Hits.Hits))
		for _, h := range page.Hits.Hits {
			ids = append(ids, h.Id)
		}
		if len(ids) == 0 {
			return nil
		}
		if err := fn(ids); err != nil {
			return err
		}
	}
}

// copyDocs copies the documents ids of from into index at their external
// version (a newer one already in index wins), in pages.
func copyDocs(ctx context.Context, client *elastic.Client, from, index string, ids []string) error {
	for len(ids) > 0 {
		page := ids[:min(len(ids), 1000)]
		ids = ids[len(page):]
		res, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
			Method: http.MethodPost,
			Path:   "/_reindex",
			Params: url.Values{"refresh": {"true"}},
			Body: map[string]any{
				"conflicts": "proceed",
				"source":    map[string]any{"index": from, "query": map[string]any{"ids": map[string]any{"values": page}}},
				"dest":      map[string]any{"index": index, "version_type": "external"},
			},
		})
		if err != nil {
			return fmt.Errorf("copy documents of %s to %s: %w", from, index, err)
		}
		var out struct {
			Failures []json.RawMessage `json:"failures"`
		}
		if err := json.Unmarshal(res.Body, &out); err != nil {
			return fmt.Errorf("copy documents of %s to %s: decode answer: %w", from, index, err)
		}
		if len(out.Failures) > 0 {
			return fmt.Errorf("copy documents of %s to %s: %d failure(s), first: %s", from, index, len(out.Failures), out.Failures[0])
		}
	}
	return nil
}

// auditForced records a move made with --force past refused checks, in
// checkpoint_audit (action "<what>-forced").
func auditForced(ctx context.Context, db *pgxpool.Pool, job, what, reason string) error {
	actor := cmp.Or(os.Getenv("USER"), "indexer")
	if _, err := db.Exec(ctx, `INSERT INTO checkpoint_audit (job, logical_run_id, partition_key, actor, reason, action) VALUES ($1, '', '', $2, $3, $4)`,
		job, actor, reason, what+"-forced"); err != nil {
		return fmt.Errorf("audit the forced %s of job %s: %w", what, job, err)
	}
	return nil
}
