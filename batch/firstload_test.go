package batch_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// A first load (normalized_records held no row of the source name when the
// run was created) writes with plain INSERTs. A chunk that meets an event
// that is there after all (here: an application's event with the id the
// batcher gives row 70's first version) rolls back and is written again
// with the guarded upsert, which skips it: the run succeeds with one event
// per row, as a run that is not a first load would.
func TestFirstLoadMeetsAnEventThatIsThereAlready(t *testing.T) {
	t.Parallel()
	for _, processor := range []bool{false, true} {
		name := map[bool]string{false: "sql", true: "go"}[processor]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url, pool := newDB(t)
			seed(t, pool, 1, 300, 1, 1) // ids 7..2100
			s := spec(func(s *batch.Spec) { s.Chunk = batch.ChunkSettings{Size: 50, Min: 50, Max: 50} })
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
			require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM batch_runs WHERE first_load`))
			require.Positive(t, queryInt(t, pool, `SELECT retries FROM batch_runs`), "the chunk with row 70 rolled back once")
			require.Equal(t, int64(300), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE NOT deleted`))
			require.Equal(t, int64(300), queryInt(t, pool, `SELECT count(DISTINCT event_id) FROM outbox_events`))
			require.Equal(t, int64(300), queryInt(t, pool, `SELECT count(*) FROM outbox_events`), "no second event for row 70")
			require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM outbox_events WHERE aggregate_id = '70' AND aggregate_type = 'app'`))
			exact(t, url, s.Job, 300)

			// The next run is not a first load.
			_, err = pool.Exec(ctx, `UPDATE source_records SET payload = payload || '{"x":1}' WHERE id = 700`)
			require.NoError(t, err)
			_, err = run(t, pool, s, cfg)
			require.NoError(t, err)
			require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM batch_runs WHERE NOT first_load`))
			require.Equal(t, int64(2), queryInt(t, pool, `SELECT count(*) FROM outbox_events WHERE aggregate_id = '700'`))
		})
	}
}

// An id the source holds twice (the id column is not the cursor and not
// unique): the first load's chunk that meets it again rolls back and is
// written with the guarded upsert, so the newer version wins as it would
// in any other run; the chunks after it stay guarded.
func TestFirstLoadMeetsAnIDTwice(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	_, err := pool.Exec(ctx, `
CREATE TABLE dup_records (k bigint PRIMARY KEY, id text NOT NULL, version bigint NOT NULL, payload jsonb NOT NULL DEFAULT '{}');
INSERT INTO dup_records (k, id, version) SELECT g, 'r' || g, 1 FROM generate_series(1, 200) g;
INSERT INTO dup_records (k, id, version) VALUES (201, 'r1', 2), (202, 'r150', 3);`)
	require.NoError(t, err)
	s := batch.Spec{
		Job:              "dups",
		Source:           batch.Source{Table: "dup_records", Cursor: []string{"k"}, ID: "id", Version: "version"},
		ProcessorVersion: "v1",
		Chunk:            batch.ChunkSettings{Size: 50, Min: 50, Max: 50},
	}
	sum, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.True(t, sum.Done)
	require.Positive(t, queryInt(t, pool, `SELECT retries FROM batch_runs`))
	require.Equal(t, int64(200), queryInt(t, pool, `SELECT count(*) FROM normalized_records`))
	require.Equal(t, int64(2), queryInt(t, pool, `SELECT source_version FROM normalized_records WHERE source_id = 'r1'`))
	require.Equal(t, int64(3), queryInt(t, pool, `SELECT source_version FROM normalized_records WHERE source_id = 'r150'`))
	require.Equal(t, int64(202), queryInt(t, pool, `SELECT count(DISTINCT event_id) FROM outbox_events`))
	require.Equal(t, int64(202), queryInt(t, pool, `SELECT count(*) FROM outbox_events`))
}
