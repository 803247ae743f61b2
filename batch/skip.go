package batch

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// ErrSkipLimit: a run quarantined more rows than the spec's skip limit
// allows (errors.skip_limit / errors.skip_ratio). The chunk that crossed it
// rolled back; the partition fails and is not retried automatically.
var ErrSkipLimit = errors.New("skip limit exceeded")

// skipTotalsSQL reads, inside a chunk's transaction (so with the chunk's
// own quarantine rows), the run's open quarantined rows, the rows its
// partitions committed before this chunk, and the most frequent open error
// code with its count. Resolved rows (quarantine retry) do not count.
const skipTotalsSQL = `
SELECT (SELECT count(*) FROM batch_quarantine WHERE job = $1 AND logical_run_id = $2 AND resolved_at IS NULL),
       (SELECT coalesce(sum(processed_count), 0) FROM batch_runs WHERE job = $1 AND logical_run_id = $2),
       t.error_code, coalesce(t.n, 0)
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
  SELECT error_code, count(*) AS n FROM batch_quarantine
  WHERE job = $1 AND logical_run_id = $2 AND resolved_at IS NULL
  GROUP BY error_code ORDER BY count(*) DESC, error_code LIMIT 1
) AS t ON true`

// checkSkipLimit fails a chunk that quarantined rows past the run's skip
// limit: more than errors.skip_limit rows, or more than errors.skip_ratio
// of the rows processed so far (this chunk included). Concurrent partitions
// each see the others' committed chunks, so together they may pass the
// count by the chunks they commit at the same moment.
func (r *Runner) checkSkipLimit(ctx context.Context, tx pgx.Tx, res chunkResult) error {
	e := r.spec.Errors
	if res.bad == 0 || (e.SkipLimit == 0 && e.SkipRatio == 0) {
		return nil
	}
	var (
		quarantined, processed, topN int64
		top                          *string
	)
	if err := tx.QueryRow(ctx, skipTotalsSQL, r.spec.Job, r.runID).Scan(&quarantined, &processed, &top, &topN); err != nil {
		return fmt.Errorf("check the skip limit: %w", err)
	}
	processed += int64(res.n)
	var past string
	switch {
	case e.SkipLimit > 0 && quarantined > int64(e.SkipLimit):
		past = fmt.Sprintf("errors.skip_limit %d", e.SkipLimit)
	case e.SkipRatio > 0 && float64(quarantined) > e.SkipRatio*float64(processed):
		past = fmt.Sprintf("errors.skip_ratio %g (%.1f%%)", e.SkipRatio, 100*float64(quarantined)/float64(processed))
	default:
		return nil
	}
	code := "unknown"
	if top != nil {
		code = *top
	}
	return fmt.Errorf("%w: run %s of job %s has quarantined %d of %d rows, past %s; most frequent error: %s (%d rows); "+
		"the chunk rolled back: see `batcher quarantine list`, fix the data or the processor (then `batcher quarantine retry`), or raise the limit",
		ErrSkipLimit, r.runID, r.spec.Job, quarantined, processed, past, code, topN)
}
