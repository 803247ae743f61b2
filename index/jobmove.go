package index

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"

	"github.com/outboxrelay/outboxrelay/internal/pgconn"
)

// A job's move (cutover, rollback, roll-forward) changes what searches find
// of that job only: see [PlanMove] for the job-aware read alias. The
// steps, under the alias's advisory lock (the one AUTO_CUTOVER takes, so
// moves of one alias never interleave):
//
//  1. plan the one _aliases call from the alias as it is;
//  2. count the documents without a processor version (application
//     events) that the move takes out of searches and the target lacks (a
//     tombstone in the target counts as having it: the row was deleted);
//     refuse unless allowed;
//  3. wait for the target's health, record the move in its _meta, make the
//     call (ApplyMove);
//  4. close the window between 2 and 3: documents without a processor
//     version written into the generation left between the count and the
//     call are copied into the target (at their external version).

// MoveOptions configure [MoveJob].
type MoveOptions struct {
	// Job names the job in messages.
	Job string
	// AllowUnversioned lets the move hide documents without a processor
	// version that the target lacks; otherwise it refuses.
	AllowUnversioned bool
	// Locked: the caller holds the alias's cutover lock already (see
	// [LockAlias]).
	Locked bool
	// BeforeMove, if set, runs between the count of documents without a
	// processor version and the alias move (tests: a write in the window).
	BeforeMove func()
	// Logger gets a line when documents are copied over; default
	// slog.Default().
	Logger *slog.Logger
}

// MoveResult is what [MoveJob] did.
type MoveResult struct {
	Plan    MovePlan
	Hidden  int64 // documents without a processor version the move hid (allowed)
	Copied  int64 // written into the generation left during the move, copied over
	Already bool
	// From lists the generation the job's documents left (empty: none).
	From []string
}

// LockAlias takes alias's cutover lock on its own connection, waiting for
// it; the returned function lets go.
func LockAlias(ctx context.Context, db *pgxpool.Pool, alias string) (func(), error) {
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

// MoveJob moves the documents of one job (aggregate type m.Type) of alias
// to m.Target, under the alias's cutover lock (taken here unless
// opts.Locked). The caller ran the readiness checks; m.JobTypes lists the
// aggregate types of every job that writes the alias.
func MoveJob(ctx context.Context, client *elastic.Client, db *pgxpool.Pool, alias, writeAlias string, m JobMove, opts MoveOptions) (MoveResult, error) {
	var res MoveResult
	if !opts.Locked {
		unlock, err := LockAlias(ctx, db, alias)
		if err != nil {
			return res, err
		}
		defer unlock()
	}
	target := m.Target
	plan, err := PlanMove(ctx, client, alias, writeAlias, m)
	res.Plan = plan
	if err != nil {
		return res, err
	}
	if plan.Noop {
		res.Already = true
		return res, ApplyMove(ctx, client, plan) // ends a bulk load left over, nothing else
	}
	if plan.Leaving != "" {
		n, _, err := hiddenUnversioned(ctx, client, plan.Leaving, plan.LeavingQuery, target, false)
		if err != nil {
			return res, err
		}
		if n > 0 && !opts.AllowUnversioned {
			return res, fmt.Errorf("%w: move of job %s to %s: %s holds %d document(s) without a processor version "+
				"(events enqueued by an application, not by a batcher job) that %s lacks; after the move searches would no longer find them. "+
				"Enqueue them again so they reach %s, or accept losing them from searches with --allow-unversioned",
				ErrUnsafeMove, opts.Job, target, plan.Leaving, n, target, target)
		}
		res.Hidden = n
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
					ErrUnsafeMove, opts.Job, target, plan.Leaving, dup, FieldAggregateType, target, opts.Job)
			}
		}
	}
	if opts.BeforeMove != nil {
		opts.BeforeMove()
	}
	if err := ApplyMove(ctx, client, plan); err != nil {
		return res, err
	}
	res.From = []string{}
	if plan.From != "" {
		res.From = []string{plan.From}
	}
	if plan.Leaving != "" && !opts.AllowUnversioned {
		// Written between the count and the call: copy them over.
		if err := Refresh(ctx, client, plan.Leaving); err != nil {
			return res, err
		}
		n, ids, err := hiddenUnversioned(ctx, client, plan.Leaving, plan.LeavingQuery, target, true)
		if err != nil {
			return res, err
		}
		if n > 0 {
			if err := CopyDocs(ctx, client, plan.Leaving, target, ids); err != nil {
				return res, err
			}
			res.Copied = n
			cmp.Or(opts.Logger, slog.Default()).Info("documents without a processor version written into the generation left during the move were copied to the new one",
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
	sel := elastic.NewBoolQuery().Filter(q).MustNot(elastic.NewExistsQuery(FieldPV))
	return scrollAbsent(ctx, client, from, sel, target, elastic.NewMatchAllQuery(), ids)
}

// untypedTwice counts the live documents of base without an aggregate type
// whose id target holds live.
func untypedTwice(ctx context.Context, client *elastic.Client, base, target string) (int64, error) {
	sel := elastic.NewBoolQuery().MustNot(elastic.NewExistsQuery(FieldAggregateType), elastic.NewTermQuery(FieldDeleted, true))
	var twice int64
	err := scrollPages(ctx, client, base, sel, func(page []string) error {
		found, err := client.Count(target).Query(elastic.NewBoolQuery().Filter(elastic.NewIdsQuery().Ids(page...)).
			MustNot(elastic.NewTermQuery(FieldDeleted, true))).Do(ctx)
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

// CopyDocs copies the documents ids of from into index at their external
// version (a newer one already in index wins), in pages.
func CopyDocs(ctx context.Context, client *elastic.Client, from, index string, ids []string) error {
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

// TryLockAlias takes alias's cutover lock when no one holds it, on its own
// connection; ok is false when another session holds it. unlock lets go.
func TryLockAlias(ctx context.Context, db *pgxpool.Pool, alias string) (unlock func(), ok bool, err error) {
	conn, err := db.Acquire(ctx)
	if err != nil {
		return nil, false, err
	}
	key := cutoverLockKey(alias)
	var locked bool
	if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, key).Scan(&locked); err != nil {
		conn.Release()
		return nil, false, fmt.Errorf("take the cutover lock of alias %s: %w", alias, err)
	}
	if !locked {
		conn.Release()
		return nil, false, nil
	}
	return func() {
		// Bounded: a stalled database must not hold up the indexer's shutdown.
		_ = pgconn.ReleaseAdvisoryLock(ctx, conn.Conn(), key)
		conn.Release()
	}, true, nil
}

// cutoverLockKey is the advisory lock key of the moves of alias.
func cutoverLockKey(alias string) int64 {
	h := fnv.New64a()
	h.Write([]byte("outboxrelay.cutover:" + strings.ToLower(alias)))
	return int64(h.Sum64())
}
