package manifest

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// liveHeaders returns the headers of a chunk's events: the live processor
// version (ce_processorversion) of the scan jobs that index the same
// documents (same topic and aggregate type, so the same alias), read in
// the chunk's transaction. With it the indexer writes the event into the
// generation searches read, like the scan job's own events, and the
// document carries that version (reconcile and the cutover's check of
// documents without a version count it as the job's). The generation a
// rebuild is building gets the change from the scan job's catch-up run
// (the row's version changed), which the cutover waits for. nil when no
// scan job writes those documents.
func liveHeaders(ctx context.Context, tx pgx.Tx, job Job) (map[string]string, error) {
	pv, err := batch.LiveVersionForEvents(ctx, tx, job.Topic, job.Target.Table)
	if err != nil {
		return nil, fmt.Errorf("manifest job %s: %w", job.JobID, err)
	}
	if pv == "" {
		return nil, nil
	}
	return map[string]string{outbox.HeaderProcessorVersion: pv}, nil
}
