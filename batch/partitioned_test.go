package batch_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
)

// partitionSource replaces the demo source table with one partitioned by
// id: source_records_low (ids below 1000) and source_records_high (below
// 100000). A unique index of a partitioned table holds its partition key,
// so the incremental cursor is (change_seq, id).
func partitionSource(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `
DROP TABLE source_records CASCADE;
CREATE TABLE source_records (
    id          bigint      NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    tenant_id   text        NOT NULL DEFAULT 'default',
    version     bigint      NOT NULL DEFAULT 1,
    change_seq  bigint      NOT NULL DEFAULT nextval('source_records_change_seq'),
    deleted_at  timestamptz,
    payload     jsonb       NOT NULL DEFAULT '{}',
    PRIMARY KEY (id)
) PARTITION BY RANGE (id);
CREATE TABLE source_records_low PARTITION OF source_records FOR VALUES FROM (MINVALUE) TO (1000);
CREATE TABLE source_records_high PARTITION OF source_records FOR VALUES FROM (1000) TO (100000);
CREATE INDEX ON source_records (created_at, id);
CREATE UNIQUE INDEX ON source_records (change_seq, id);
CREATE TRIGGER source_records_bump BEFORE UPDATE ON source_records FOR EACH ROW EXECUTE FUNCTION source_records_bump();`)
	require.NoError(t, err)
}

func partitionedIncremental(job string) batch.Spec {
	s := incremental(job)
	s.Source.Cursor = []string{"change_seq", "id"}
	return s
}

// A write that names a partition locks the partition, not the partitioned
// table: a run start must wait for it as for a write through the table,
// or a change value below the boundary could commit after the boundary was
// read and never be read.
func TestRunWaitsForAWriterOfAPartition(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	partitionSource(t, pool)
	seed(t, pool, 1, 300, 1, 3)
	s := partitionedIncremental("parted-writer")
	writer, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer writer.Rollback(ctx)
	_, err = writer.Exec(ctx, `UPDATE source_records_low SET payload = jsonb_set(payload, '{title}', '"open"') WHERE id = 7`)
	require.NoError(t, err)
	var pid int
	require.NoError(t, writer.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))

	r, err := batch.NewRunner(pool, s, batch.Config{OpenWritersWait: 300 * time.Millisecond})
	require.NoError(t, err)
	_, err = r.Prepare(ctx)
	require.ErrorIs(t, err, batch.ErrOpenWriters)
	require.Contains(t, err.Error(), fmt.Sprintf("(pid %d)", pid))
}

// The delete capture of a partitioned source table is installed on its
// partitions too: a statement that names a partition fires only the
// partition's statement triggers. Deletes and truncates of a partition
// reach normalized_records and the outbox like those of the table (a
// truncated partition's rows as the rows no longer in the table); a
// partition created after the install, or a capture trigger disabled or
// enabled for replicas only (it then never fires), stops an incremental
// run with the partition named instead of losing its deletes.
func TestFollowCarriesDeletesOfAPartition(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := newDB(t)
	partitionSource(t, pool)
	seed(t, pool, 1, 300, 1, 3) // ids 7..2100; 142 below 1000
	s := deletingJob(t, pool, "parted-deletes", func(s *batch.Spec) { s.Source.Cursor = []string{"change_seq", "id"} })
	f := followDeletes(t, pool, s)
	_, err := pool.Exec(ctx, `DELETE FROM source_records_low WHERE id IN (14, 21)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `TRUNCATE source_records_high`)
	require.NoError(t, err)
	waitFor(t, followLatency, "the delete events", func() bool { return len(deleteEvents(t, url)) == 2+158 })
	require.Equal(t, int64(140), liveRows(t, pool))
	require.Equal(t, []string{"14@2", "21@2"}, deleteEvents(t, url)[:2])
	_, err = f.stop(t)
	require.NoError(t, err)

	// A TRUNCATE of the whole table fires its partitions' triggers too:
	// it records markers, never a row per id.
	before := queryInt(t, pool, `SELECT coalesce(max(id), 0) FROM batch_deletes`)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `TRUNCATE source_records`)
	require.NoError(t, err)
	var ids, truncates int64
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(source_id), count(*) FILTER (WHERE truncated) FROM batch_deletes WHERE id > $1`, before).Scan(&ids, &truncates))
	require.Zero(t, ids)
	require.EqualValues(t, 1, truncates)
	require.NoError(t, tx.Rollback(ctx))

	refused := func(what string) {
		t.Helper()
		_, err := run(t, pool, s, batch.Config{})
		require.ErrorIs(t, err, batch.ErrSpec, what)
		require.Contains(t, err.Error(), "follow-trigger --install", what)
	}
	_, err = pool.Exec(ctx, `CREATE TABLE source_records_top PARTITION OF source_records FOR VALUES FROM (100000) TO (200000)`)
	require.NoError(t, err)
	refused("a partition created after the install")
	_, err = pool.Exec(ctx, batch.FollowTriggerSQL(s))
	require.NoError(t, err)
	_, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)

	_, err = pool.Exec(ctx, `ALTER TABLE source_records_low ENABLE REPLICA TRIGGER `+batch.CaptureTrigger)
	require.NoError(t, err)
	refused("a capture trigger enabled for replicas only")
	_, err = pool.Exec(ctx, `ALTER TABLE source_records_low ENABLE TRIGGER `+batch.CaptureTrigger+`; DROP TRIGGER outboxrelay_capture_truncate ON source_records`)
	require.NoError(t, err)
	refused("no truncate capture")
}
