package manifest_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/manifest"
)

// 43 approved orders with non-contiguous ids, chunk size 10 (a last short
// chunk of 3), other tenants' and unapproved orders around them: every
// approved order changes exactly once, nothing else changes.
func TestDrainChangesEachApprovedOrderOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, fixtureOpts{ids: nonContiguousIDs(43), chunkSize: 10})
	f.register(t)
	f.checkExactlyOnce(t, 0)

	res, err := manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{MaxChunks: 2})
	require.NoError(t, err)
	require.Equal(t, manifest.StoppedMaxChunks, res.Stopped)
	require.Len(t, res.Chunks, 2)
	require.Equal(t, 20, res.NextIndex)
	require.Equal(t, manifest.StateRunning, res.State)
	f.checkExactlyOnce(t, 20)

	var seen []string
	res, err = manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{OnChunk: func(c manifest.Chunk) { seen = append(seen, c.IDs...) }})
	require.NoError(t, err)
	require.Equal(t, manifest.StoppedCompleted, res.Stopped)
	require.Len(t, res.Chunks, 3)
	require.Equal(t, 40, res.Chunks[2].From)
	require.Len(t, res.Chunks[2].IDs, 3, "last short chunk")
	require.Equal(t, res.ProcessedIDs, seen)
	require.Equal(t, manifest.StateSucceeded, res.State)
	f.checkExactlyOnce(t, 43)

	// Another drain of a finished job: an empty, successful answer.
	res, err = manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{})
	require.NoError(t, err)
	require.Empty(t, res.Chunks)
	require.Equal(t, manifest.StoppedCompleted, res.Stopped)
	require.Equal(t, 43, res.NextIndex)
	f.checkExactlyOnce(t, 43)

	rep, err := manifest.ReadReport(ctx, f.pool, f.jobID)
	require.NoError(t, err)
	require.Len(t, rep.Approved, 43)
	require.Equal(t, rep.Approved, rep.Committed)
	require.Equal(t, rep.Approved, rep.Matching)
	require.Empty(t, rep.Unprocessed)
	require.Empty(t, rep.Verification)
}

// After chunk 1 commits, order 15 is modified by someone else: chunk 2
// rolls back (orders 11–14 unchanged), chunk 1 stays, the job is conflicted
// and says why, and it is not retried.
func TestConflictRollsBackTheChunkAndStops(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, fixtureOpts{ids: contiguousIDs(40), chunkSize: 10})
	f.register(t)
	_, err := manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{MaxChunks: 1})
	require.NoError(t, err)
	f.checkExactlyOnce(t, 10)

	// Someone else changes order 15's quantity; the trigger bumps its revision.
	_, err = f.pool.Exec(ctx, `UPDATE orders SET qty = 99 WHERE id = 15`)
	require.NoError(t, err)
	f.origRevs[15]++ // the other writer's revision, which must stay
	before := f.snapshot(t)

	res, err := manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{})
	var ce *manifest.ConflictError
	require.ErrorAs(t, err, &ce)
	require.ErrorIs(t, err, manifest.ErrConflicted)
	require.True(t, ce.Now)
	require.Equal(t, manifest.StoppedConflict, res.Stopped)
	require.Empty(t, res.Chunks)
	require.Equal(t, 1, ce.Conflict.Chunk)
	require.Len(t, ce.Conflict.Items, 1)
	require.Equal(t, "15", ce.Conflict.Items[0].ID)
	require.Equal(t, 14, ce.Conflict.Items[0].Seq)
	require.Contains(t, ce.Conflict.Items[0].Differences, "revision: approved 1, found 2")
	require.Contains(t, ce.Conflict.Items[0].Differences, "qty: approved 1, found 99")

	after := f.snapshot(t)
	require.Equal(t, before.Orders, after.Orders, "orders 11–20 unchanged")
	require.Equal(t, before.Audit, after.Audit)
	require.Equal(t, before.Outbox, after.Outbox)
	require.Equal(t, 10, after.NextIndex)
	require.Equal(t, manifest.StateConflicted, after.State)
	f.checkExactlyOnce(t, 10)

	// Not retried, not repaired: the next drain refuses at once.
	_, err = manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{})
	require.ErrorAs(t, err, &ce)
	require.False(t, ce.Now)
	require.Equal(t, "15", ce.Conflict.Items[0].ID)
	require.Equal(t, after, f.snapshot(t))

	rep, err := manifest.ReadReport(ctx, f.pool, f.jobID)
	require.NoError(t, err)
	require.Equal(t, manifest.StateConflicted, rep.Job.State)
	require.NotNil(t, rep.Job.Conflict)
	require.Equal(t, "15", rep.Job.Conflict.Items[0].ID)
	require.Len(t, rep.Committed, 10)
	require.Len(t, rep.Unprocessed, 30)
	require.Contains(t, rep.String(), "id 15 (position 14): revision: approved 1, found 2")
}

// The conflict explanation names each kind of difference.
func TestConflictExplainsEachDifference(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		change string
		want   string
	}{
		{"deleted", `DELETE FROM orders WHERE id = 3`, "missing (no row with this id)"},
		{"other status", `UPDATE orders SET status = 'shipped', revision = revision WHERE id = 3`, `status: approved "pending", found "shipped"`},
		{"other tenant", `UPDATE orders SET tenant_id = 'other', revision = revision WHERE id = 3`, `tenant: approved "alien-desserts", found "other"`},
		{"other qty same revision", `UPDATE orders SET qty = 42, revision = revision WHERE id = 3`, "qty: approved 4, found 42"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, fixtureOpts{ids: contiguousIDs(5), chunkSize: 5})
			f.register(t)
			// The trigger only bumps the revision when the writer does not set
			// it; "revision = revision" keeps it so only one thing differs.
			_, err := f.pool.Exec(ctx, `ALTER TABLE orders DISABLE TRIGGER orders_bump_revision`)
			require.NoError(t, err)
			_, err = f.pool.Exec(ctx, tc.change)
			require.NoError(t, err)
			before := f.snapshot(t)
			_, err = manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{})
			var ce *manifest.ConflictError
			require.ErrorAs(t, err, &ce)
			require.Len(t, ce.Conflict.Items, 1)
			require.Equal(t, "3", ce.Conflict.Items[0].ID)
			require.Equal(t, []string{tc.want}, ce.Conflict.Items[0].Differences)
			after := f.snapshot(t)
			require.Equal(t, before.Orders, after.Orders)
			require.Empty(t, after.Audit)
			require.Empty(t, after.Outbox)
		})
	}
}

// Tampered progress is refused by verification before anything changes.
func TestVerificationRefusesTamperedProgress(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		chunks int // committed before tampering
		tamper string
		want   string
	}{
		{"next_index without audit", 1, `UPDATE manifest_jobs SET next_index = 20`, "position 10 (id 11) is before next_index but has no audit row"},
		{"next_index mid-chunk", 1, `UPDATE manifest_jobs SET next_index = 5`, "next_index 5 points into the middle of chunk 0"},
		{"next_index past the end", 1, `UPDATE manifest_jobs SET next_index = 50`, "next_index 50 is past the end of the 40 approved items"},
		{"audit row with another id", 2, `UPDATE manifest_audit SET item_id = '999' WHERE seq = 12`, "audit row at position 12 has id 999, the approved list has 13"},
		{"audit row with other revisions", 1, `UPDATE manifest_audit SET after_revision = after_revision + 1 WHERE seq = 3`, "audit row at position 3 (id 4)"},
		{"audit row missing", 1, `DELETE FROM manifest_audit WHERE seq = 9`, "position 9 (id 10) is before next_index but has no audit row"},
		{"progress moved back", 2, `UPDATE manifest_jobs SET next_index = 10`, "audit row at position 10 (id 11) is at or past next_index 10"},
		{"succeeded too early", 1, `UPDATE manifest_jobs SET state = 'succeeded'`, "state is succeeded but next_index is 10 of 40"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, fixtureOpts{ids: contiguousIDs(40), chunkSize: 10})
			f.register(t)
			_, err := manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{MaxChunks: tc.chunks})
			require.NoError(t, err)
			_, err = f.pool.Exec(ctx, tc.tamper)
			require.NoError(t, err)
			before := f.snapshot(t)

			_, err = manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{})
			var pe *manifest.ProgressError
			require.ErrorAs(t, err, &pe)
			require.ErrorIs(t, err, manifest.ErrProgressMismatch)
			require.Contains(t, err.Error(), tc.want)
			require.Contains(t, err.Error(), "nothing was changed or repaired")
			require.Equal(t, before, f.snapshot(t), "nothing changed")

			rep, err := manifest.ReadReport(ctx, f.pool, f.jobID)
			require.NoError(t, err)
			require.NotEmpty(t, rep.Verification)
			require.Contains(t, rep.String(), "verification FAILED")
		})
	}
}

// The report splits committed ids into matching, drifted and missing after
// committed orders are modified or deleted; a new order with the same
// quantity does not stand in for a deleted one.
func TestReportMatchingDriftedMissing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, fixtureOpts{ids: contiguousIDs(40), chunkSize: 10})
	f.register(t)
	_, err := manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{MaxChunks: 2})
	require.NoError(t, err)

	for _, q := range []string{
		`UPDATE orders SET qty = qty + 1 WHERE id = 3`,                                                                 // drifted: qty and revision
		`UPDATE orders SET status = 'pending' WHERE id = 12`,                                                           // drifted: reopened
		`DELETE FROM orders WHERE id IN (7, 20)`,                                                                       // missing
		`UPDATE orders SET qty = 3 WHERE id = 25`,                                                                      // unprocessed: not reported as drift
		`INSERT INTO orders (id, tenant_id, revision, status, qty) VALUES (5000, 'alien-desserts', 3, 'cancelled', 3)`, // same qty as order 7, other id
	} {
		_, err := f.pool.Exec(ctx, q)
		require.NoError(t, err, q)
	}

	rep, err := manifest.ReadReport(ctx, f.pool, f.jobID)
	require.NoError(t, err)
	ids := func(from, to int) []string {
		var out []string
		for i := from; i <= to; i++ {
			out = append(out, strconv.Itoa(i))
		}
		return out
	}
	require.Equal(t, ids(1, 40), rep.Approved)
	require.Equal(t, ids(1, 20), rep.Committed)
	require.Equal(t, ids(21, 40), rep.Unprocessed)
	require.Equal(t, []string{"3", "12"}, rep.Drifted)
	require.Equal(t, []string{"7", "20"}, rep.Missing)
	var matching []string
	for _, id := range ids(1, 20) {
		if id != "3" && id != "12" && id != "7" && id != "20" {
			matching = append(matching, id)
		}
	}
	require.Equal(t, matching, rep.Matching)
	require.Len(t, rep.Drift, 2)
	require.Equal(t, manifest.Drift{ID: "3", Differences: []string{"revision: committed 2, now 3", "qty: committed 4, now 5"}}, rep.Drift[0])
	require.Equal(t, manifest.Drift{ID: "12", Differences: []string{"revision: committed 2, now 3", `status: committed "cancelled", now "pending"`}}, rep.Drift[1])
	require.Empty(t, rep.Verification, "the audit is intact")
}

func TestDrainUnknownJob(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{ids: contiguousIDs(3), chunkSize: 2})
	_, err := manifest.Drain(context.Background(), f.pool, "nope", manifest.DrainOptions{})
	require.True(t, errors.Is(err, manifest.ErrNotFound), "%v", err)
}

// The approved list is frozen in the database too: an UPDATE or DELETE of
// its items, a TRUNCATE, or a change of what the job was approved as
// (target, transition, item count, chunk size, hashes) is refused, before
// a drain could apply unapproved values or stop short of the last items.
// Progress (next_index, state) stays writable: its tampering is what
// verification catches (above).
func TestApprovedListCannotBeChanged(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, fixtureOpts{ids: contiguousIDs(40), chunkSize: 10})
	f.register(t)
	_, err := manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{MaxChunks: 1})
	require.NoError(t, err)
	before := f.snapshot(t)
	for _, tamper := range []string{
		`UPDATE manifest_items SET revision = revision + 1 WHERE seq = 35`,
		`UPDATE manifest_items SET fields = '{}' WHERE seq = 35`,
		`DELETE FROM manifest_items WHERE seq = 35`,
		`TRUNCATE manifest_items CASCADE`,
		`UPDATE manifest_jobs SET item_count = 30`,
		`UPDATE manifest_jobs SET chunk_size = 5`,
		`UPDATE manifest_jobs SET spec = spec || '{"topic": "elsewhere"}'`,
		`UPDATE manifest_jobs SET items_hash = 'x'`,
	} {
		_, err := f.pool.Exec(ctx, tamper)
		require.ErrorContains(t, err, "frozen", tamper)
	}
	require.Equal(t, before, f.snapshot(t), "nothing changed")
	_, err = manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{})
	require.NoError(t, err)
	rep, err := manifest.ReadReport(ctx, f.pool, f.jobID)
	require.NoError(t, err)
	require.Len(t, rep.Committed, 40)
}

// A target table whose ids repeat across tenants (its key is (tenant_id,
// id)): the drain changes only the job's tenant's rows, and the report and
// a conflict's explanation look at those rows only — another tenant's row
// with the same id is neither a second copy of the item nor its drift.
func TestIdsRepeatedAcrossTenants(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, fixtureOpts{ids: contiguousIDs(6), chunkSize: 3})
	_, err := f.pool.Exec(ctx, `ALTER TABLE orders DROP CONSTRAINT orders_pkey, ADD PRIMARY KEY (tenant_id, id);
INSERT INTO orders (id, tenant_id, revision, status, qty) SELECT id, 'another-tenant', 1, 'pending', 99 FROM generate_series(1, 6) id`)
	require.NoError(t, err)
	f.register(t)
	_, err = manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{MaxChunks: 1})
	require.NoError(t, err)
	rep, err := manifest.ReadReport(ctx, f.pool, f.jobID)
	require.NoError(t, err)
	require.Equal(t, []string{"1", "2", "3", "4", "5", "6"}, rep.Approved)
	require.Equal(t, []string{"1", "2", "3"}, rep.Committed)
	require.Equal(t, []string{"1", "2", "3"}, rep.Matching)
	require.Empty(t, rep.Drifted)
	require.Empty(t, rep.Verification)

	// Item 5 changed under the approval: the conflict names this tenant's
	// row, not the other tenant's.
	_, err = f.pool.Exec(ctx, `UPDATE orders SET qty = qty + 1 WHERE id = 5 AND tenant_id = $1`, testTenant)
	require.NoError(t, err)
	_, err = manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{})
	var ce *manifest.ConflictError
	require.ErrorAs(t, err, &ce)
	require.Len(t, ce.Conflict.Items, 1)
	require.Equal(t, "5", ce.Conflict.Items[0].ID)
	require.NotContains(t, fmt.Sprint(ce.Conflict.Items[0]), "another-tenant")
}
