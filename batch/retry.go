package batch

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// maxPartitionBackoff caps the doubling wait between automatic retries of a
// failed partition.
const maxPartitionBackoff = 10 * time.Minute

// failOrRetrySQL records a failed attempt: back to pending with retry_at
// while attempts are left ($5 = how many in all), failed otherwise. SET
// reads the old row, so failures there is the count before this one.
const failOrRetrySQL = `
UPDATE batch_runs SET
  failures = failures + 1, error = $6, last_error = $6,
  state = CASE WHEN failures + 1 < $5 THEN 'pending' ELSE 'failed' END,
  retry_at = CASE WHEN failures + 1 < $5 THEN now() + least($7::interval * power(2, failures), $8::interval) END,
  finished_at = CASE WHEN failures + 1 < $5 THEN NULL ELSE now() END,
  updated_at = now(), lease_token = NULL, lease_owner = NULL` + fence + `
RETURNING state, failures, retry_at`

// failOrRetry records that the claimed partition failed with cause. It
// returns when a worker may retry it, or nil when it is failed for good
// (no attempts left, or an error that a retry would meet again).
func (r *Runner) failOrRetry(ctx context.Context, cl *claim, cause error) (retryAt *time.Time, failures int, err error) {
	attempts := r.spec.Errors.PartitionAttempts
	if permanentFailure(cause) {
		attempts = 1
	}
	var state string
	err = r.pool.QueryRow(ctx, failOrRetrySQL, r.spec.Job, r.runID, cl.key, cl.token, attempts, cause.Error(),
		time.Duration(r.spec.Errors.PartitionBackoff).String(), maxPartitionBackoff.String()).Scan(&state, &failures, &retryAt)
	if err != nil {
		return nil, 0, fmt.Errorf("record the failure of %s/%s/%s: %w", r.spec.Job, r.runID, cl.key, err)
	}
	return retryAt, failures, nil
}

// permanentFailure: errors that another attempt would meet again.
func permanentFailure(err error) bool {
	var bad *BadRowError
	return errors.As(err, &bad) || errors.Is(err, ErrSpec) || errors.Is(err, ErrCheckpointIncompatible) ||
		errors.Is(err, ErrCheckpointInvariant) || errors.Is(err, ErrSkipLimit)
}
