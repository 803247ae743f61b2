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

// checkSkipLimit fails a chunk that quarantined rows past the run's skip
// limit: more than errors.skip_limit rows, or, once the run processed
// errors.skip_ratio_min_rows rows (this chunk included), more than
// errors.skip_ratio of them. Concurrent partitions each see the others'
// committed chunks, so together they may pass the count by the chunks they
// commit at the same moment.
//
// A chunk without quarantined rows can only lower the share, except while
// the sample is not reached yet: until this process has seen a chunk
// reach it, every chunk reads the totals, so the first chunk at the
// sample is judged on the bad rows before it.
func (r *Runner) checkSkipLimit(ctx context.Context, tx pgx.Tx, res chunkResult) error {
	e := r.spec.Errors
	judgeRatio := e.SkipRatio > 0 && !r.ratioSampled.Load()
	if (res.bad == 0 && !judgeRatio) || (e.SkipLimit == 0 && e.SkipRatio == 0) {
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
	sampled := processed >= int64(e.SkipRatioMinRows)
	var past string
	switch {
	case e.SkipLimit > 0 && quarantined > int64(e.SkipLimit):
		past = fmt.Sprintf("errors.skip_limit %d", e.SkipLimit)
	case e.SkipRatio > 0 && sampled && float64(quarantined) > e.SkipRatio*float64(processed):
		past = fmt.Sprintf("errors.skip_ratio %g (%.1f%%, judged from errors.skip_ratio_min_rows %d rows)", e.SkipRatio, 100*float64(quarantined)/float64(processed), e.SkipRatioMinRows)
	default:
		if sampled {
			// Judged at the sample and below it: from now on only chunks
			// with quarantined rows can raise the share.
			r.ratioSampled.Store(true)
		}
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
