// Package batch runs resumable, snapshot-bounded scan jobs: it reads a
// source table in keyset chunks between a stored cursor and a boundary fixed
// when the run started, and commits, in ONE transaction per chunk, the
// normalized rows (normalized_records, guarded so an older source version
// never overwrites a newer one), one outbox event per changed row (with a
// deterministic event id) and the checkpoint. A crash anywhere loses nothing
// and duplicates nothing: the next run resumes from the last committed
// checkpoint.
//
// A job is described by a [Spec] (YAML or JSON, see [LoadSpec]): the table,
// the cursor columns (an immutable order column plus a unique tie-breaker),
// the version and soft-delete columns, an optional partition column and
// filter, the document fields with simple normalizers (rename, trim, lower,
// drop nulls), the processor version, the topic, chunk settings and the
// bad-row policy. The built-in normalizers compile to SQL, so a chunk runs
// inside the server as one statement (select the range → upsert RETURNING
// the changed rows → insert their outbox events), then the checkpoint UPDATE
// fenced by the lease token and the previous cursor; a custom [Processor] reads the chunk into Go and writes it back
// with unnest arrays, in the same transaction. A first load (a run created
// while normalized_records held no row of the source name) writes both
// tables with plain INSERTs, without the per-row conflict check; a chunk
// that meets a row or an event that is there after all rolls back and is
// written again the guarded way, and so is the rest of its partition.
//
// A partition worker keeps chunk.pipeline chunks in flight (default 2), each
// in its own transaction on its own connection: it first reads where chunk N
// ends (a keyset LIMIT query over the cursor columns only, never OFFSET),
// so chunk N+1 runs while chunk N commits; a last chunk shorter than the
// chunk size runs as two halves at once. They commit strictly in cursor
// order: chunk N+1 locks the checkpoint row after chunk N holds it, so it
// waits for N's COMMIT or ROLLBACK, and its UPDATE matches only if the
// stored cursor is N's end. If N fails, N+1 rolls back and the worker goes
// on (or stops) from the last committed checkpoint. While N+1 waits, its
// transaction is idle, and the server ends a session idle in a chunk
// transaction for the lease TTL (set per transaction, so a frozen worker's
// session ends within one heartbeat interval after its lease expires);
// N+1 therefore reads its lease every second (every third of the TTL if
// that is shorter), which restarts that timer and rolls N+1 back at once
// if another worker took the partition. The same read checks that N's
// backend is still in a transaction: if N is stuck outside the server (a
// custom Processor that ignores its context), N+1 rolls back rather than
// hold its locks for as long; and whether N waits for a lock N+1 holds (an
// id in both chunks, when the id column is not unique), a deadlock the
// server cannot see, which N+1 ends by rolling back. A chunk may take
// longer than the lease.
//
// A run is (job, logical run id, partition). Partitions run in parallel,
// claimed by workers with FOR UPDATE SKIP LOCKED leases and heartbeats;
// every checkpoint write is conditioned on the lease token and the previous
// cursor, so a worker that lost its lease writes nothing. Resuming with
// another processor version or scope is refused with [ErrCheckpointIncompatible]
// unless the operator restarts or declares the version compatible.
//
// Each job has one live processor version, the one whose index generation
// searches read (batch_processor_versions): its first run records it
// (unless migration 016 registered another version of the job: then the
// first cutover or rollback does), and an indexer cutover or rollback
// moves it ([SetLiveVersion]). A run at a
// version never live is the rebuild of that version's generation and runs;
// a run at a version that was live before and is not now (an old schedule
// after a cutover, the new one after a rollback) is refused with a
// [LiveVersionError] unless StartOptions.Rebuild declares it.
//
// A full run (Spec.Vanished = delete, the default) ends with a sweep: once
// every partition succeeded, the live rows of normalized_records for the
// job's source name whose source row is gone or out of scope become
// tombstones and delete events, in chunks by source_id, each one
// transaction with its checkpoint in batch_sweeps and fenced by the sweep's
// lease; the next start resumes an unfinished sweep. The tombstone's version
// is the last normalized version + 1 (see [VanishedDelete]).
//
// A custom [Processor] reads from its context which chunk it works on
// ([ChunkInfoFrom]; [ChunkInfo.IdempotencyKey] is the run id, attempt and
// a hash of the call's rows, for its external calls), calls [Wait] before each external call (the
// job's token bucket, [Config].RateLimit, metered by
// batch_rate_limit_wait_seconds), and returns a [*RetryAfterError] when a
// service answers 429 with Retry-After: the chunk is retried no sooner and
// the bucket pauses until then.
//
// A partition that fails (a chunk's retries ran out, or its error is not
// transient) goes back to pending and is retried automatically by any
// worker after errors.partition_backoff, doubling, up to
// errors.partition_attempts attempts in all; `batcher status` shows the
// attempts, the failures and the last error.
//
// In test builds (the failpoint build tag; release binaries have none),
// crash tests can kill the process at named points with
// OUTBOXRELAY_FAILPOINT (see internal/failpoint): batch.before_tx,
// batch.after_upsert, batch.after_outbox, batch.after_checkpoint (before
// COMMIT) and batch.after_commit (before the log line); in the sweep,
// batch.sweep_after_delete, batch.sweep_after_checkpoint and
// batch.sweep_after_commit. The upsert and the
// outbox insert are two CTE steps of one statement (measured 25% faster than
// passing the changed rows through a temp table), so after_upsert and
// after_outbox both fire after that statement, inside the open transaction.
//
// Functions take a [DB]: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
// [NewRunner] alone takes a *pgxpool.Pool, since its workers hold
// connections of their own (one per chunk in flight) and size their
// pipelines by the pool.
//
// Stopping is by context only, no Start/Stop: every call that blocks ends
// when its ctx does. [Runner.Run] takes two: cancelling soft finishes the
// chunk in flight, releases the lease and returns at the last committed
// checkpoint; cancelling hard also rolls the chunk in flight back. The
// bookkeeping after a stop (releasing a lease, recording a failure) runs
// on a detached, bounded context, so a stopped run still records where it
// stands.
//
// A [Follower] runs an incremental job continuously (batcher run
// --follow): one ordinary run after another while the change column moves
// past what the last finished run covered, and otherwise a wait for a
// NOTIFY from the trigger [FollowTriggerSQL] installs, or for its poll
// interval. Each run keeps every guarantee above.
//
// An incremental job with Spec.Vanished = delete carries hard deletes,
// truncates and rows that left the scope: the trigger FollowTriggerSQL
// installs captures deleted ids into batch_deletes in the writer's
// transaction, and the transaction that creates each run tombstones the
// live normalized rows of the captures and of the rows out of scope past
// the job's marks (batch_delete_marks, moved in the same transaction),
// before the run's chunks read the rows written since; the follower also
// wakes on a capture. Failpoints: batch.deletes_after_tombstones,
// batch.deletes_after_mark (both before COMMIT) and
// batch.deletes_after_commit.
//
// Manifest jobs (seed 003: finish a batch over a frozen, approved list)
// are a different kind of job and live in package manifest.
//
// Example:
//
//	spec, err := batch.LoadSpec("records.yaml")
//	if err != nil { ... }
//	r, err := batch.NewRunner(pool, spec, batch.Config{Logger: logger, Workers: 4})
//	if err != nil { ... }
//	sum, err := r.Run(softCtx, hardCtx) // soft: stop at a chunk boundary; hard: roll back
//	fmt.Println(sum.RunID, sum.Rows, sum.Done)
package batch
