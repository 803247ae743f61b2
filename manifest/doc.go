// Package manifest runs manifest jobs (seed 003): it finishes an
// interrupted batch over a frozen, approved list of items.
//
// An operator registers a list of items (id, approved revision, expected
// field values) with a tenant, a target table, a transition (status from →
// to, revision + 1) and a chunk size ([Parse], [Register]). The list is
// sorted by id and frozen: registering the same content again, in any order,
// is a no-op; the same job id with other content is a
// [*RegistrationConflictError].
//
// [Drain] applies the list chunk by chunk. Each chunk is one transaction: it
// locks the job row FOR UPDATE, verifies the progress against the audit
// (same ids, order, revisions and approved fields; no progress without an
// audit row, none mid-chunk, none past the end), takes the next chunk by
// next_index into the frozen list (never by re-querying the target), applies
// the conditional UPDATE (tenant, id, revision, status and the match fields,
// compared as typed values of the target's columns), writes one audit row per
// item, enqueues one outbox event per changed row and advances next_index.
// An item that no longer matches rolls back its whole chunk and stops the job
// as conflicted ([*ConflictError]); finished chunks stay and nothing is
// retried. A mismatch found by verification stops the drain
// ([*ProgressError]) without changing or repairing anything.
//
// [ReadReport] lists approved, committed and unprocessed ids and the current
// state of each committed id (matching, drifted, missing).
//
// In test builds (the failpoint build tag; release binaries have none),
// crash tests can kill the process at named points with
// OUTBOXRELAY_FAILPOINT (see internal/failpoint): manifest.after_update,
// manifest.after_audit, manifest.after_next_index and manifest.after_commit.
//
// Example:
//
//	spec, err := manifest.Parse(file)
//	reg, err := manifest.Register(ctx, pool, spec)
//	res, err := manifest.Drain(ctx, pool, spec.JobID, manifest.DrainOptions{MaxChunks: 2})
//	rep, err := manifest.ReadReport(ctx, pool, spec.JobID)
package manifest
