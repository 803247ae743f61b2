package manifest_test

import (
	"context"
	"encoding/json"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/testproc"
	"github.com/outboxrelay/outboxrelay/manifest"
)

// poolIn opens a pool whose sessions use the given TimeZone.
func poolIn(t *testing.T, url, tz string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["timezone"] = tz
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// A trigger on the target table rewrites a match field when the chunk
// cancels an order (qty → 0). The chunk matched the approved qty, so it
// commits; every later drain must still verify the audit against the
// approval and go on, and the report must call the rows as the chunk left
// them matching.
func TestDrainResumesWhenATriggerRewritesAMatchField(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, fixtureOpts{ids: nonContiguousIDs(25), chunkSize: 10})
	_, err := f.pool.Exec(ctx, `
CREATE FUNCTION orders_zero_qty() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'cancelled' AND OLD.status <> 'cancelled' THEN NEW.qty := 0; END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER orders_zero_qty BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION orders_zero_qty();`)
	require.NoError(t, err)
	f.register(t)

	_, err = manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{MaxChunks: 1})
	require.NoError(t, err)
	res, err := manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{})
	require.NoError(t, err, "a later drain resumes")
	require.Equal(t, manifest.StoppedCompleted, res.Stopped)
	f.checkExactlyOnce(t, 25)

	rep, err := manifest.ReadReport(ctx, f.pool, f.jobID)
	require.NoError(t, err)
	require.Empty(t, rep.Verification)
	require.Equal(t, rep.Approved, rep.Matching, "as the chunk (and its trigger) left them: %v", rep.Drift)

	// A later change of the rewritten field is still drift.
	_, err = f.pool.Exec(ctx, `UPDATE orders SET qty = 7 WHERE id = $1`, f.ids[0])
	require.NoError(t, err)
	rep, err = manifest.ReadReport(ctx, f.pool, f.jobID)
	require.NoError(t, err)
	require.Len(t, rep.Drift, 1)
	require.Contains(t, rep.Drift[0].Differences, "qty: committed 0, now 7")
}

// A timestamptz match field approved in one time zone (+09:00) is drained
// by a session in another (America/New_York) and reported from a third
// (Asia/Kolkata): the same instants, so no conflict and no drift; a real
// change of the instant is drift.
func TestTimestampMatchFieldsCompareAsInstantsInAnyTimeZone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, fixtureOpts{ids: nonContiguousIDs(12), chunkSize: 5})
	_, err := f.pool.Exec(ctx, `ALTER TABLE orders ADD COLUMN promised_at timestamptz NOT NULL DEFAULT '2024-05-01 09:00:00+00'`)
	require.NoError(t, err)
	f.spec["target"].(map[string]any)["match_fields"] = []string{"qty", "promised_at"}
	for _, it := range f.spec["items"].([]map[string]any) {
		it["fields"].(map[string]any)["promised_at"] = "2024-05-01T18:00:00+09:00"
	}
	f.file = f.writeFile(t, f.spec)
	f.register(t)

	ny := poolIn(t, f.url, "America/New_York")
	res, err := manifest.Drain(ctx, ny, f.jobID, manifest.DrainOptions{})
	require.NoError(t, err, "the same instant is no conflict")
	require.Equal(t, manifest.StoppedCompleted, res.Stopped)
	f.checkExactlyOnce(t, 12)

	kolkata := poolIn(t, f.url, "Asia/Kolkata")
	rep, err := manifest.ReadReport(ctx, kolkata, f.jobID)
	require.NoError(t, err)
	require.Empty(t, rep.Verification)
	require.Equal(t, rep.Approved, rep.Matching, "%v", rep.Drift)

	_, err = f.pool.Exec(ctx, `UPDATE orders SET promised_at = promised_at + interval '1 hour' WHERE id = $1`, f.ids[3])
	require.NoError(t, err)
	rep, err = manifest.ReadReport(ctx, kolkata, f.jobID)
	require.NoError(t, err)
	require.Len(t, rep.Drift, 1)
	require.Equal(t, f.ids[3], mustAtoi(t, rep.Drift[0].ID))
	require.Len(t, rep.Drift[0].Differences, 2, "revision and promised_at: %v", rep.Drift[0].Differences)
}

func mustAtoi(t *testing.T, s string) int64 {
	t.Helper()
	var n int64
	require.NoError(t, json.Unmarshal([]byte(s), &n))
	return n
}

// A chunk commits between the report's read of the progress and its check
// of the audit: the report still reads one snapshot and says the
// verification is ok. Not parallel: the hook is package-wide.
func TestReportIsOneSnapshotWhileADrainCommits(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t, fixtureOpts{ids: nonContiguousIDs(30), chunkSize: 10})
	f.register(t)
	_, err := manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{MaxChunks: 1})
	require.NoError(t, err)

	drained := false
	defer manifest.SetReportHook(func(string) {
		if drained {
			return
		}
		drained = true
		_, err := manifest.Drain(ctx, f.pool, f.jobID, manifest.DrainOptions{MaxChunks: 1})
		require.NoError(t, err)
	})()
	rep, err := manifest.ReadReport(ctx, f.pool, f.jobID)
	require.NoError(t, err)
	require.True(t, drained, "the hook ran")
	require.Empty(t, rep.Verification, "a chunk that committed during the report is no verification failure")
	require.NotContains(t, rep.String(), "FAILED")
	require.Len(t, rep.Committed, 10, "the report's snapshot")
	f.checkExactlyOnce(t, 20)
}

// A drainer stops (SIGSTOP, not a crash) inside a chunk transaction that
// holds the job row. The server ends its session after the idle timeout, so
// a second drainer takes the job over and finishes it; the stuck one, when
// it wakes, cannot commit its chunk: every item changed exactly once.
func TestStuckDrainerLosesTheJobToAnother(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	bin := testproc.Build(t, "batcher")
	f := newFixture(t, fixtureOpts{ids: nonContiguousIDs(30), chunkSize: 10})
	f.register(t)

	// Another writer holds the first order: the drainer's UPDATE waits for
	// it inside the chunk transaction, which then holds the job row.
	tx, err := f.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM orders WHERE id = $1 FOR UPDATE`, f.ids[0])
	require.NoError(t, err)
	stuck := testproc.Start(t, bin, f.env(), "manifest", "drain", "--job", f.jobID, "--lock-timeout", "2m", "--idle-timeout", "2s")
	waitFor(t, time.Minute, "the drainer waits for the order inside its chunk", func() bool {
		var waiting int
		require.NoError(t, f.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting))
		return waiting == 1
	})
	require.NoError(t, stuck.Signal(syscall.SIGSTOP))
	defer func() { _ = stuck.Signal(syscall.SIGCONT) }()
	// The UPDATE finishes on the server; the stopped client never sends the
	// rest of its chunk, so its session sits idle in the transaction.
	require.NoError(t, tx.Commit(ctx))

	other := testproc.Run(t, procTimeout, bin, f.env(), "manifest", "drain", "--job", f.jobID, "--json")
	require.Equal(t, 0, other.ExitCode(), other.Stderr())
	var res manifest.DrainResult
	require.NoError(t, json.Unmarshal([]byte(other.Stdout()), &res), other.Stdout())
	require.Equal(t, manifest.StoppedCompleted, res.Stopped)
	require.Len(t, res.ProcessedIDs, 30, "the second drainer did every chunk")

	require.NoError(t, stuck.Signal(syscall.SIGCONT))
	var exit *exec.ExitError
	require.ErrorAs(t, stuck.Wait(procTimeout), &exit, "the stuck drainer cannot commit: %s", stuck.Stdout())
	t.Logf("the stuck drainer: %s", stuck.Stderr())
	require.NotContains(t, stuck.Stdout(), "chunk 0 committed")
	f.checkExactlyOnce(t, 30)
}
