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
RETURNING r.partition_key, r.lease_token::text, r.cursor, r.boundary, COALESCE(r.chunk_size, 0), r.processed_count, r.estimated_total, r.attempt, r.first_load`

const (
	unfinishedSQL = `SELECT count(*) FROM batch_runs WHERE job = $1 AND logical_run_id = $2 AND ($3::text IS NULL OR partition_key = $3) AND state IN ('pending', 'running')`
	heartbeatSQL  = `UPDATE batch_runs SET heartbeat_at = now(), lease_expires_at = now() + $5::interval` + fence
	leaseStateSQL = `SELECT state, lease_token::text FROM batch_runs WHERE job = $1 AND logical_run_id = $2 AND partition_key = $3`
	releaseSQL    = `UPDATE batch_runs SET state = 'pending', updated_at = now(), lease_token = NULL, lease_owner = NULL` + fence
	notFreshSQL   = `UPDATE batch_runs SET first_load = false, updated_at = now()` + fence
	finishSQL     = `UPDATE batch_runs SET state = 'succeeded', finished_at = now(), updated_at = now(), lease_token = NULL, lease_owner = NULL` + fence
	// leaseCursorSQL reads the checkpoint under the lease.
	leaseCursorSQL = `SELECT cursor FROM batch_runs` + fence
	// waitCheckSQL: is the lease held, is backend $5 in a transaction
	// (after clearStatSnapshotSQL on the same transaction), and does it wait
	// for a lock this backend holds.
	waitCheckSQL = `SELECT EXISTS (SELECT FROM batch_runs` + fence + `), EXISTS (SELECT FROM pg_stat_activity WHERE pid = $5 AND state IS DISTINCT FROM 'idle'),
  pg_backend_pid() = ANY(pg_blocking_pids($5::int))`
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

const (
	// createSweepSQL: a new full run that sweeps.
	createSweepSQL = `INSERT INTO batch_sweeps (job, logical_run_id) VALUES ($1, $2) ON CONFLICT DO NOTHING`
	// createSweptSQL: a new full run whose sweep has nothing to look at
	// (see sourceEmptySQL) gets it as done already.
	createSweptSQL = `INSERT INTO batch_sweeps (job, logical_run_id, state, started_at, finished_at) VALUES ($1, $2, 'succeeded', now(), now()) ON CONFLICT DO NOTHING`
	// sourceEmptySQL reports whether normalized_records holds no row, live
	// or tombstone, of a source name. A run that starts then (a first load)
	// skips its sweep: the rows it writes are rows its chunks saw, and one
	// the source loses after its chunk read it is left to the next full
	// run's sweep, as a row deleted just after any run is. Its chunks also
	// expect their rows and events to be new (batch_runs.first_load).
	sourceEmptySQL = `SELECT NOT EXISTS (SELECT FROM normalized_records WHERE source = $1)`
	// retrySweepSQL: a rerun retries a failed sweep, as it does a failed
	// partition.
	retrySweepSQL = `UPDATE batch_sweeps SET state = 'pending', error = NULL, finished_at = NULL, updated_at = now() WHERE job = $1 AND logical_run_id = $2 AND state = 'failed'`
	// supersedeSweepSQL: --restart.
	supersedeSweepSQL = `UPDATE batch_sweeps SET state = 'superseded', lease_token = NULL, lease_owner = NULL, updated_at = now(), finished_at = now() WHERE job = $1 AND logical_run_id = $2 AND state <> 'succeeded'`
	// unfinishedSweepRunSQL is the newest run of the job whose sweep is not
	// over, even though its partitions are.
	unfinishedSweepRunSQL = `
SELECT w.logical_run_id FROM batch_sweeps w
WHERE w.job = $1 AND w.state IN ('pending', 'running', 'failed')
  AND NOT EXISTS (SELECT 1 FROM batch_runs r WHERE r.job = $1 AND r.created_at > w.created_at)
ORDER BY w.created_at DESC LIMIT 1`

	claimSweepSQL = `
UPDATE batch_sweeps SET state = 'running', lease_owner = $3, lease_token = gen_random_uuid(), heartbeat_at = now(),
  lease_expires_at = now() + $4::interval, attempt = attempt + 1, started_at = COALESCE(started_at, now()), updated_at = now(), error = NULL
WHERE job = $1 AND logical_run_id = $2
  AND (state = 'pending' OR (state = 'running' AND (lease_token IS NULL OR lease_expires_at < now())))
RETURNING lease_token::text, cursor, attempt`

	sweepStateSQL = `SELECT state FROM batch_sweeps WHERE job = $1 AND logical_run_id = $2`

	sweepFence = ` WHERE job = $1 AND logical_run_id = $2 AND lease_token = $3::uuid AND state = 'running'`

	heartbeatSweepSQL = `UPDATE batch_sweeps SET heartbeat_at = now(), lease_expires_at = now() + $4::interval` + sweepFence
	// checkpointSweepSQL is also fenced by the cursor the chunk started
	// after: a second sweeper cannot interleave.
	checkpointSweepSQL = `
UPDATE batch_sweeps SET cursor = $5, swept_count = swept_count + $6, deleted_count = deleted_count + $7, chunks = chunks + 1,
  checkpoint_at = now(), updated_at = now()` + sweepFence + ` AND cursor IS NOT DISTINCT FROM $4`
	finishSweepSQL  = `UPDATE batch_sweeps SET state = 'succeeded', finished_at = now(), updated_at = now(), lease_token = NULL, lease_owner = NULL` + sweepFence
	releaseSweepSQL = `UPDATE batch_sweeps SET updated_at = now(), lease_token = NULL, lease_owner = NULL` + sweepFence
	failSweepSQL    = `UPDATE batch_sweeps SET state = 'failed', error = $4, finished_at = now(), updated_at = now(), lease_token = NULL, lease_owner = NULL` + sweepFence

	sweepPartitionsSQL = `SELECT coalesce(array_agg(partition_key), '{}') FROM batch_runs WHERE job = $1 AND logical_run_id = $2`
)

const sweepStatusSQL = `
SELECT job, logical_run_id, state, cursor, swept_count, deleted_count, rebuilt_count, rebuilt_changed, attempt, lease_owner, error, checkpoint_at, finished_at
FROM (SELECT *, row_number() OVER (PARTITION BY job ORDER BY created_at DESC) AS rn FROM batch_sweeps WHERE $1 = '' OR job = $1) w
WHERE rn <= $2
ORDER BY job, created_at DESC`

// otherJobsSQL: the last specs of the other jobs, for checkSharedSourceName.
const otherJobsSQL = `SELECT job, spec FROM batch_jobs WHERE job <> $1 ORDER BY job`

// sweepSettingsSQL: a sweep chunk's transaction-local lock_timeout ($1)
// and idle_in_transaction_session_timeout ($2), in milliseconds.
const sweepSettingsSQL = `SELECT set_config('lock_timeout', $1, true), set_config('idle_in_transaction_session_timeout', $2, true)`

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

const lockJobSQL = `SELECT pg_advisory_xact_lock(hashtextextended('outboxrelay.batch:' || $1, 0))`

// saveJobSQL stores the spec ($2) and records its document ($4) as the one
// processor version $3 ran with, keeping the other versions' documents.
const saveJobSQL = `
INSERT INTO batch_jobs (job, spec)
VALUES ($1, $2::jsonb || jsonb_build_object('` + documentsByPVKey + `', jsonb_build_object($3::text, $4::jsonb)))
ON CONFLICT (job) DO UPDATE SET
  spec = EXCLUDED.spec || jsonb_build_object('` + documentsByPVKey + `',
           coalesce(batch_jobs.spec->'` + documentsByPVKey + `', '{}'::jsonb) || (EXCLUDED.spec->'` + documentsByPVKey + `')),
  updated_at = now()`

// rerunPartitionsSQL is what starting a run that exists does to its
// partitions: a failed one is pending again with a new budget of attempts,
// and one waiting for its automatic retry (its batcher stopped or died
// during the backoff) may be claimed at once, keeping its failures. A
// rerun is the operator's word that the cause is fixed; a second batcher
// joining a run in progress counts as one too.
const rerunPartitionsSQL = `
UPDATE batch_runs SET
  failures = CASE WHEN state = 'failed' THEN 0 ELSE failures END,
  state = 'pending', error = CASE WHEN state = 'failed' THEN NULL ELSE error END,
  retry_at = NULL, finished_at = NULL, updated_at = now()
WHERE job = $1 AND logical_run_id = $2 AND (state = 'failed' OR (state = 'pending' AND retry_at IS NOT NULL))`

// openWritersSQL lists the transactions holding a write lock on table ($1)
// or one of its partitions (a write that names a partition locks the
// partition only) in this database, other than this one's; $2, when not
// NULL, keeps only those virtual transaction ids.
const openWritersSQL = `SELECT l.virtualtransaction, min(l.pid)
FROM pg_locks l
WHERE l.locktype = 'relation' AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.relation IN (SELECT to_regclass($1)::oid UNION SELECT relid::oid FROM pg_partition_tree(to_regclass($1))) AND l.granted
  AND l.mode IN ('RowExclusiveLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock')
  AND l.pid IS DISTINCT FROM pg_backend_pid() AND l.virtualtransaction IS NOT NULL
  AND ($2::text[] IS NULL OR l.virtualtransaction = ANY($2::text[]))
GROUP BY l.virtualtransaction`

// openWritersFresh is how recent batch_open_writers.checked_at must be
// for a row to count as a run start waiting now (status, the gauge) and for
// a new wait to keep its since (a follower's retries). A waiting batcher
// renews it every few seconds, and a follower retries within its poll
// interval (at most 30 s).
const openWritersFresh = `interval '1 minute'`

// openWritersWaitingSQL records that job $1's run start has waited $4
// seconds for transactions $3 that wrote $2, and gave up if $5; $6: a
// follower waits, and tries again after giving up. since is kept from a
// row still fresh (an earlier attempt).
const openWritersWaitingSQL = `
INSERT INTO batch_open_writers AS w (job, source, writers, since, checked_at, expired_at, follower)
VALUES ($1, $2, $3, now() - make_interval(secs => $4::float8), now(), CASE WHEN $5::bool THEN now() END, $6)
ON CONFLICT (job) DO UPDATE SET source = EXCLUDED.source, writers = EXCLUDED.writers,
  since = CASE WHEN w.checked_at > now() - ` + openWritersFresh + ` THEN least(w.since, EXCLUDED.since) ELSE EXCLUDED.since END,
  checked_at = now(), expired_at = EXCLUDED.expired_at, follower = EXCLUDED.follower`

// openWritersDoneSQL: job $1's run start waits no more.
const openWritersDoneSQL = `DELETE FROM batch_open_writers WHERE job = $1`

// unfinishedRunSQL is the newest run of job $1 that is not finished.
const unfinishedRunSQL = `
SELECT logical_run_id FROM batch_runs WHERE job = $1
GROUP BY logical_run_id
HAVING bool_or(state IN ('pending', 'running', 'paused', 'failed'))
ORDER BY max(created_at) DESC LIMIT 1`

// loadRunSQL locks and reads the partitions of run $1/$2.
const loadRunSQL = `SELECT partition_key, state, processor_version, scope_hash, scope FROM batch_runs WHERE job = $1 AND logical_run_id = $2 ORDER BY partition_key FOR UPDATE`

// supersedeRunSQL: --restart (or a backward checkpoint move) replaces run $1/$2.
const supersedeRunSQL = `UPDATE batch_runs SET state = 'superseded', lease_token = NULL, lease_owner = NULL, updated_at = now(), finished_at = now() WHERE job = $1 AND logical_run_id = $2 AND state <> 'succeeded'`

// resumeVersionSQL moves run $1/$2 to processor version $3 (--resume).
const resumeVersionSQL = `UPDATE batch_runs SET processor_version = $3, updated_at = now() WHERE job = $1 AND logical_run_id = $2`

// auditResumeSQL audits a --resume across processor versions.
const auditResumeSQL = `INSERT INTO checkpoint_audit (job, logical_run_id, partition_key, actor, reason, action) VALUES ($1, $2, '', $3, $4, 'resume-compatible')`

// previousBoundarySQL: where an incremental run of partition $2 starts, the
// boundary of the last succeeded run at the same processor version and scope.
const previousBoundarySQL = `SELECT boundary FROM batch_runs WHERE job = $1 AND partition_key = $2 AND state = 'succeeded' AND processor_version = $3 AND scope_hash = $4 AND boundary IS NOT NULL ORDER BY finished_at DESC LIMIT 1`

// createPartitionSQL creates one partition of a new run.
const createPartitionSQL = `
INSERT INTO batch_runs (job, logical_run_id, partition_key, state, mode, start_cursor, cursor, boundary, processor_version, scope_hash, scope, estimated_total, chunk_size, first_load, finished_at)
VALUES ($1, $2, $3, $4, $5, $6, $6, $7, $8, $9, $10, $11, $12, $13, CASE WHEN $4 = 'succeeded' THEN now() END)`

// storedDocumentSQL reads job $1's stored spec and the document processor
// version $2 last ran with.
const storedDocumentSQL = `SELECT spec, spec->'` + documentsByPVKey + `'->$2 FROM batch_jobs WHERE job = $1`

// auditDocumentSQL audits a document change declared compatible.
const auditDocumentSQL = `INSERT INTO checkpoint_audit (job, logical_run_id, partition_key, actor, reason, action) VALUES ($1, '', '', $2, $3, 'document-compatible')`

// estimateTimeoutSQL bounds the exact count of a run's rows (savepoint-local).
const estimateTimeoutSQL = `SELECT set_config('statement_timeout', '2s', true)`

// runLeftSQL counts the partitions of run $1/$2 not succeeded.
const runLeftSQL = `SELECT count(*) FROM batch_runs WHERE job = $1 AND logical_run_id = $2 AND state <> 'succeeded'`

// chunkSettingsSQL: a chunk's transaction-local lock_timeout ($1) and
// idle_in_transaction_session_timeout ($2), in milliseconds, and work_mem
// (see Runner.chunk).
const chunkSettingsSQL = `SELECT set_config('lock_timeout', $1, true), set_config('work_mem', '64MB', true), set_config('idle_in_transaction_session_timeout', $2, true)`

// noLockTimeoutSQL: the wait for the previous chunk in flight is ordering,
// bounded by that chunk's own lock timeout.
const noLockTimeoutSQL = `SELECT set_config('lock_timeout', '0', true)`

// lockCheckpointSQL locks the checkpoint row of partition $1/$2/$3.
const lockCheckpointSQL = `SELECT 1 FROM batch_runs WHERE job = $1 AND logical_run_id = $2 AND partition_key = $3 FOR UPDATE`

// statusSQL lists the partitions of the newest $2 runs of job $1 ("" = all).
const statusSQL = `
WITH recent AS (
  SELECT job, logical_run_id, max(created_at) AS created, row_number() OVER (PARTITION BY job ORDER BY max(created_at) DESC) AS rn
  FROM batch_runs WHERE ($1 = '' OR job = $1) GROUP BY job, logical_run_id
)
SELECT b.job, b.logical_run_id, b.partition_key, b.state, b.mode, b.cursor, b.boundary, b.processor_version,
       b.processed_count, b.changed_count, b.estimated_total,
       (SELECT count(*) FROM batch_quarantine q WHERE q.job = b.job AND q.logical_run_id = b.logical_run_id AND q.partition_key = b.partition_key AND q.resolved_at IS NULL),
       b.retries, b.chunk_size, b.lease_owner, b.attempt, b.failures, b.error, b.last_error, b.retry_at, b.started_at, b.checkpoint_at, b.created_at,
       COALESCE(extract(epoch FROM now() - b.checkpoint_at), 0)
FROM batch_runs b JOIN recent r USING (job, logical_run_id)
WHERE r.rn <= $2
ORDER BY b.job, r.created DESC, b.partition_key`

// newestRunSQL is job $1's newest run.
const newestRunSQL = `SELECT logical_run_id FROM batch_runs WHERE job = $1 ORDER BY created_at DESC LIMIT 1`

// setStateSQL moves the partitions of run $1/$2 ($3 "" = all) in states $4 to $5.
const setStateSQL = `UPDATE batch_runs SET state = $5, lease_token = NULL, lease_owner = NULL, updated_at = now()
WHERE job = $1 AND logical_run_id = $2 AND ($3 = '' OR partition_key = $3) AND state = ANY($4)`

// lockCheckpointMoveSQL locks and reads a partition for a manual checkpoint move.
const lockCheckpointMoveSQL = `SELECT state, cursor, boundary, processed_count, lease_token IS NOT NULL AND lease_expires_at > now()
FROM batch_runs WHERE job = $1 AND logical_run_id = $2 AND partition_key = $3 FOR UPDATE`

// moveCheckpointSQL moves a checkpoint forward by hand.
const moveCheckpointSQL = `UPDATE batch_runs SET cursor = $4, updated_at = now() WHERE job = $1 AND logical_run_id = $2 AND partition_key = $3`

// auditForwardSQL audits a forward checkpoint move.
const auditForwardSQL = `INSERT INTO checkpoint_audit (job, logical_run_id, partition_key, actor, reason, action, before_cursor, after_cursor, before_processed) VALUES ($1, $2, $3, $4, $5, 'forward', $6, $7, $8)`

// copyRunSQL: a backward checkpoint move copies run $1/$2 into the new
// run $3, partition $4 at cursor $5 with its count restarted.
const copyRunSQL = `
INSERT INTO batch_runs (job, logical_run_id, partition_key, state, mode, start_cursor, cursor, boundary, processor_version, scope_hash, scope, estimated_total, chunk_size, processed_count, finished_at)
SELECT job, $3, partition_key, CASE WHEN partition_key = $4 OR state <> 'succeeded' THEN 'pending' ELSE state END, mode, start_cursor,
       CASE WHEN partition_key = $4 THEN $5 ELSE cursor END, boundary, processor_version, scope_hash, scope, estimated_total, chunk_size,
       CASE WHEN partition_key = $4 THEN 0 ELSE processed_count END, CASE WHEN partition_key = $4 OR state <> 'succeeded' THEN NULL ELSE finished_at END
FROM batch_runs WHERE job = $1 AND logical_run_id = $2`

// auditBackwardSQL audits a backward checkpoint move (a new run).
const auditBackwardSQL = `INSERT INTO checkpoint_audit (job, logical_run_id, partition_key, actor, reason, action, before_cursor, after_cursor, before_processed, new_logical_run_id) VALUES ($1, $2, $3, $4, $5, 'backward-new-run', $6, $7, $8, $9)`

// listQuarantineSQL lists job $1's quarantined rows ("" = every job; $2: resolved ones too).
const listQuarantineSQL = `SELECT job, logical_run_id, partition_key, source_id, error_code, message, attempts, first_seen_at, last_seen_at, resolved_at
FROM batch_quarantine WHERE ($1 = '' OR job = $1) AND ($2 OR resolved_at IS NULL) ORDER BY job, first_seen_at, source_id`

// openQuarantineSQL groups job $1's open quarantined rows by run and partition.
const openQuarantineSQL = `SELECT logical_run_id, partition_key, array_agg(source_id ORDER BY source_id) FROM batch_quarantine WHERE job = $1 AND resolved_at IS NULL GROUP BY 1, 2`

// loadSpecSQL is the spec job $1 last ran with, without the documents of
// earlier processor versions.
const loadSpecSQL = `SELECT spec - '` + documentsByPVKey + `' FROM batch_jobs WHERE job = $1`

// followColumnSQL reads the type of column $2 of table $1 and the name
// quote_ident gives the table in the trigger's payload.
const followColumnSQL = `
SELECT (SELECT format_type(a.atttypid, a.atttypmod) FROM pg_attribute a
        WHERE a.attrelid = to_regclass($1) AND a.attname = $2 AND NOT a.attisdropped),
       quote_ident($3) || '.' || quote_ident($4)`

// runCreatedSinceSQL: whether every partition of run $2 of job $1 was
// created at or after $3 (NULL when the run has none).
const runCreatedSinceSQL = `SELECT bool_and(created_at >= $3) FROM batch_runs WHERE job = $1 AND logical_run_id = $2`
