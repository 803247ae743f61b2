package batch

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/outboxrelay/outboxrelay/internal/tracing"
)

// The relation phase of a run (relations.go): under the sweep's lease,
// the roots queued in batch_relation_work are rebuilt in chunks. Each
// chunk is one transaction: it deletes up to chunk.size work rows, rebuilds
// those roots with the scan's own statement (by ids, every partition;
// quarantine and the version guard as a scan chunk's), writes their events
// and counts itself in batch_sweeps, fenced by the lease token. A crash
// rolls the chunk back and its roots stay queued; a root rebuilt twice
// yields one event (the second finds its document unchanged).

// Failpoints of a relation chunk.
const (
	failpointRelAfterUpsert = "batch.relations_after_upsert" // documents and events written, not committed
	failpointRelAfterCommit = "batch.relations_after_commit" // committed
)

// rebuildRelations works through the job's relation work. stopped is true
// when a soft stop ended it at a chunk boundary (the lease released).
func (r *Runner) rebuildRelations(soft, hard, ctx context.Context, l *sweepLease, cleanup context.Context, token string, log *slog.Logger) (stopped bool, err error) {
	size := r.spec.Chunk.Size
	var roots, changed int64
	start := time.Now()
	for {
		if soft.Err() != nil {
			if err := l.release(cleanup); err != nil {
				log.Warn("release the sweep lease", slog.String("error", err.Error()))
			}
			log.Info("relation rebuild stopped at a chunk boundary", slog.Int64("roots", roots))
			return true, nil
		}
		var n, ch int64
		err := r.retrySweepChunk(ctx, "relation", log, func() (err error) {
			n, ch, err = r.relChunk(ctx, token, size)
			return err
		})
		if err != nil {
			return false, r.sweepChunkFailed(ctx, hard, cleanup, l, "relation rebuild", log, err)
		}
		roots, changed = roots+n, changed+ch
		if n > 0 {
			log.Info("relation chunk committed", slog.Int64("roots", n), slog.Int64("changed", ch))
		}
		if n < int64(size) {
			break
		}
	}
	if roots > 0 {
		log.Info("relation rebuild done", slog.Int64("roots", roots), slog.Int64("changed", changed), slog.Duration("took", time.Since(start)))
	}
	return false, nil
}

func (r *Runner) relChunk(ctx context.Context, token string, size int) (n, changed int64, err error) {
	ctx, span := tracing.Start(ctx, "batch.relation_chunk")
	defer span.End()
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		return 0, 0, fmt.Errorf("begin relation chunk: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if _, err := tx.Exec(ctx, sweepSettingsSQL,
		strconv.FormatInt(time.Duration(r.spec.Chunk.LockTimeout).Milliseconds(), 10), strconv.FormatInt(r.cfg.LeaseTTL.Milliseconds(), 10)); err != nil {
		return 0, 0, fmt.Errorf("begin relation chunk: %w", err)
	}
	if _, err := tx.Exec(ctx, relLockSharedSQL, r.spec.Job); err != nil {
		return 0, 0, fmt.Errorf("begin relation chunk: %w", err)
	}
	var ids []string
	if err := tx.QueryRow(ctx, relWorkSQL, r.spec.Job, size).Scan(&ids); err != nil {
		return 0, 0, fmt.Errorf("take the relation work: %w", err)
	}
	if len(ids) == 0 {
		return 0, 0, nil
	}
	a := &args{IDs: ids, Job: r.spec.Job, Run: r.runID, Source: r.spec.SourceName, PV: r.spec.ProcessorVersion, TP: tracing.Arg(ctx)}
	st := r.c.chunkWork
	var rows, bad int64
	var firstBad *string
	var last []string
	if err := tx.QueryRow(ctx, st.sql, st.bind(a)...).Scan(&rows, &bad, &firstBad, &changed, &last); err != nil {
		return 0, 0, fmt.Errorf("rebuild %d roots (%s … %s): %w", len(ids), ids[0], ids[len(ids)-1], err)
	}
	if bad > 0 && r.spec.Errors.Policy != PolicyQuarantine {
		return 0, 0, parseBadRow(*firstBad)
	}
	hit(failpointRelAfterUpsert)
	tag, err := tx.Exec(ctx, relCheckpointSQL, r.spec.Job, r.runID, token, int64(len(ids)), changed)
	if err != nil {
		return 0, 0, fmt.Errorf("write relation checkpoint: %w", err)
	}
	if tag.RowsAffected() != 1 {
		return 0, 0, fmt.Errorf("%w: the sweep of %s/%s", ErrLeaseLost, r.spec.Job, r.runID)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, 0, fmt.Errorf("commit relation chunk: %w", err)
	}
	hit(failpointRelAfterCommit)
	r.changed.Add(changed)
	r.bad.Add(bad)
	m := r.cfg.Metrics
	m.relationRoots(r.spec.Job, "changed", changed)
	m.relationRoots(r.spec.Job, "unchanged", rows-changed-bad)
	m.relationRoots(r.spec.Job, "quarantined", bad)
	return int64(len(ids)), changed, nil
}
