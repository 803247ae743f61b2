package batch_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// A first load (normalized_records held no row of the source name when the
// run was created) writes with plain INSERTs. A chunk that meets an event
// that is there after all (here: an application's event with the id the
// batcher gives row 70's first version) rolls back, and the partition is
// written again from its checkpoint with the guarded upsert, which skips
// that event as any run would (the outbox holds one event per id: row 70's
// is the application's). Not on the chunk's retry budget: it holds with
// max_retries -1 too.
func TestFirstLoadMeetsAnEventThatIsThereAlready(t *testing.T) {
	t.Parallel()
	for _, processor := range []bool{false, true} {
		name := map[bool]string{false: "sql", true: "go"}[processor]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url, pool := newDB(t)
			seed(t, pool, 1, 300, 1, 1) // ids 7..2100
			s := spec(func(s *batch.Spec) {
				s.Chunk = batch.ChunkSettings{Size: 50, Min: 50, Max: 50}
				s.Errors.MaxRetries = -1
			})
			_, err := outbox.Enqueue(ctx, pool, outbox.Event{ID: outbox.EventID("source_records", "70", 1, "v1"), Topic: "app-events",
				AggregateType: "app", AggregateID: "70", AggregateVersion: 1, Payload: []byte(`{"from":"the application"}`)})
			require.NoError(t, err)
			cfg := batch.Config{}
			if processor {
				cfg.Processor = batch.ProcessorFunc(passThrough)
			}
			sum, err := run(t, pool, s, cfg)
			require.NoError(t, err)
			require.True(t, sum.Done)
			require.Equal(t, int64(0), queryInt(t, pool, `SELECT count(*) FROM batch_runs WHERE first_load`), "the partition writes guarded from then on")
			require.Equal(t, int64(300), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE NOT deleted`))
			require.Equal(t, int64(300), queryInt(t, pool, `SELECT count(DISTINCT event_id) FROM outbox_event_members`))
			require.Equal(t, int64(300), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members`), "no second event for row 70")
			require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members WHERE aggregate_id = '70' AND aggregate_type = 'app'`))
			exact(t, url, s.Job, 300)

			// The next run is not a first load.
			_, err = pool.Exec(ctx, `UPDATE source_records SET payload = payload || '{"x":1}' WHERE id = 700`)
			require.NoError(t, err)
			_, err = run(t, pool, s, cfg)
			require.NoError(t, err)
			require.Equal(t, int64(2), queryInt(t, pool, `SELECT count(DISTINCT logical_run_id) FROM batch_runs WHERE NOT first_load`))
			require.Equal(t, int64(2), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members WHERE aggregate_id = '700'`))
		})
	}
}

// An id the source holds twice (the id column is not the cursor and not
// unique): the first load's chunk that meets it again rolls back and the
// partition is written again from its checkpoint with the guarded upsert,
// so the newer version wins as it would in any other run. Here chunk 2
// (rows 51..100) writes rX (row 55) and then meets r10 again (row 90),
// while chunk 3, in flight behind it, writes rX again (row 120): chunk 3
// must roll back with it rather than hold rX while chunk 2's guarded
// retry waits for it; and when chunk 3 wrote rX first, chunk 2 waits for
// it while chunk 3 waits for chunk 2's commit, which only chunk 3 rolling
// back (errYield) undoes before a lock timeout. No retry budget, and a
// lock timeout of a minute: neither may be what ends the wait.
func TestFirstLoadMeetsAnIDTwice(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := newDB(t)
	_, err := pool.Exec(ctx, `
CREATE TABLE dup_records (k bigint PRIMARY KEY, id text NOT NULL, version bigint NOT NULL, payload jsonb NOT NULL DEFAULT '{}');
INSERT INTO dup_records (k, id, version) SELECT g, 'r' || g, 1 FROM generate_series(1, 200) g;
UPDATE dup_records SET id = 'rX' WHERE k = 55;
UPDATE dup_records SET id = 'r10', version = 2 WHERE k = 90;
UPDATE dup_records SET id = 'rX', version = 2 WHERE k = 120;
INSERT INTO dup_records (k, id, version) VALUES (201, 'r1', 2), (202, 'r150', 3);`)
	require.NoError(t, err)
	s := batch.Spec{
		Job:              "dups",
		Source:           batch.Source{Table: "dup_records", Cursor: []string{"k"}, ID: "id", Version: "version"},
		ProcessorVersion: "v1",
		Chunk:            batch.ChunkSettings{Size: 50, Min: 50, Max: 50, LockTimeout: batch.Duration(time.Minute)},
		Errors:           batch.ErrorPolicy{MaxRetries: -1, PartitionAttempts: 1},
	}
	sum, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.True(t, sum.Done)
	pool, err = pgxpool.New(ctx, url) // read over a new connection
	require.NoError(t, err)
	defer pool.Close()
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM batch_runs WHERE first_load`))
	require.Equal(t, int64(198), queryInt(t, pool, `SELECT count(*) FROM normalized_records`))
	for id, v := range map[string]int64{"r1": 2, "r10": 2, "rX": 2, "r150": 3, "r11": 1} {
		require.Equal(t, v, queryInt(t, pool, `SELECT source_version FROM normalized_records WHERE source_id = $1`, id), id)
	}
	require.Equal(t, int64(202), queryInt(t, pool, `SELECT count(DISTINCT event_id) FROM outbox_event_members`))
	require.Equal(t, int64(202), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members`))
}
