package batch

// The package's SQL over its own tables (batch_runs, batch_sweeps,
// batch_jobs, batch_quarantine, checkpoint_audit), in one place. The
// statements over the user's source table are built from the spec in
// compile.go (and sweep.go's sweepSQL), with identifiers quoted.

// Partition leases (lease.go). Every write of a holder is fenced by its
// token: $1 job, $2 run, $3 partition key, $4 token.
const fence = ` WHERE job = $1 AND logical_run_id = $2 AND partition_key = $3 AND lease_token = $4::uuid AND state = 'running'`

// claimSQL: $1 job, $2 run, $3 partition (NULL: any), $4 owner, $5 TTL.
const claimSQL = `
UPDATE batch_runs r SET state = 'running', lease_owner = $4, lease_token = gen_random_uuid(), heartbeat_at = now(), lease_expires_at = now() + $5::interval,
  attempt = r.attempt + 1, started_at = COALESCE(r.started_at, now()), updated_at = now(), error = NULL
FROM (
  SELECT job, logical_run_id, partition_key FROM batch_runs
  WHERE job = $1 AND logical_run_id = $2 AND ($3::text IS NULL OR partition_key = $3)
    AND ((state = 'pending' AND (retry_at IS NULL OR retry_at <= now())) OR (state = 'running' AND (lease_token IS NULL OR lease_expires_at < now())))
  ORDER BY partition_key
  FOR UPDATE SKIP LOCKED
  LIMIT 1
) c
WHERE r.job = c.job AND r.logical_run_id = c.logical_run_id AND r.partition_key = c.partition_key
RETURNING r.partition_key, r.lease_token::text, r.cursor, r.boundary, COALESCE(r.chunk_size, 0), r.processed_count, r.estimated_total, r.attempt`

const (
	unfinishedSQL = `SELECT count(*) FROM batch_runs WHERE job = $1 AND logical_run_id = $2 AND ($3::text IS NULL OR partition_key = $3) AND state IN ('pending', 'running')`
	heartbeatSQL  = `UPDATE batch_runs SET heartbeat_at = now(), lease_expires_at = now() + $5::interval` + fence
	leaseStateSQL = `SELECT state, lease_token::text FROM batch_runs WHERE job = $1 AND logical_run_id = $2 AND partition_key = $3`
	releaseSQL    = `UPDATE batch_runs SET state = 'pending', updated_at = now(), lease_token = NULL, lease_owner = NULL` + fence
	finishSQL     = `UPDATE batch_runs SET state = 'succeeded', finished_at = now(), updated_at = now(), lease_token = NULL, lease_owner = NULL` + fence
	// leaseCursorSQL reads the checkpoint under the lease.
	leaseCursorSQL = `SELECT cursor FROM batch_runs` + fence
	// waitCheckSQL: is the lease held, and is backend $5 in a transaction
	// (after clearStatSnapshotSQL on the same transaction).
	waitCheckSQL         = `SELECT EXISTS (SELECT FROM batch_runs` + fence + `), EXISTS (SELECT FROM pg_stat_activity WHERE pid = $5 AND state IS DISTINCT FROM 'idle')`
	clearStatSnapshotSQL = `SELECT pg_stat_clear_snapshot()`
)

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
