package batch_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
)

// holdAndFail fails the chunk that holds failID, but only once the next
// chunk is in flight and has written its rows (its transaction waits, idle,
// for this one): the next chunk's writes must then roll back with it.
type holdAndFail struct {
	failAfter
	pool    *pgxpool.Pool
	failID  string
	nextID  string // first id of the chunk after the failing one
	fail    atomic.Bool
	once    sync.Once
	sawNext chan struct{}
}

func (h *holdAndFail) Process(ctx context.Context, rows []batch.SourceRow) ([]batch.Result, error) {
	if rows[0].ID == h.nextID {
		h.once.Do(func() { close(h.sawNext) })
	}
	for _, r := range rows {
		if h.fail.Load() && r.ID == h.failID {
			select {
			case <-h.sawNext:
			case <-time.After(time.Minute):
				return nil, fmt.Errorf("the next chunk never started: no chunk in flight next to this one")
			}
			// Both transactions open: this one (processing) and the next
			// one, written and waiting for this one to commit.
			deadline := time.Now().Add(time.Minute)
			for {
				var idle int
				if err := h.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle in transaction'`).Scan(&idle); err != nil {
					return nil, err
				}
				if idle >= 2 {
					break
				}
				if time.Now().After(deadline) {
					return nil, fmt.Errorf("the next chunk never wrote")
				}
				time.Sleep(10 * time.Millisecond) // polling a server-side condition
			}
			return nil, fmt.Errorf("processor failed on id %s", r.ID)
		}
	}
	return h.failAfter.Process(ctx, rows)
}

func TestPipelineCommitsInOrderUnderFailure(t *testing.T) {
	t.Parallel()
	url, pool := newDB(t)
	seed(t, pool, 0, 3000, 3, 1) // ids 7g in cursor order; 500-row chunks
	s := spec(func(s *batch.Spec) { s.Chunk.Pipeline = 2 })
	// Chunk 2 (rows 1000..1499) fails at row 1250 while chunk 3 (1500..) is
	// in flight.
	p := &holdAndFail{pool: pool, failID: "8750", nextID: "10500", sawNext: make(chan struct{})}
	p.fail.Store(true)
	_, err := run(t, pool, s, batch.Config{Processor: p})
	require.ErrorContains(t, err, "processor failed on id 8750")

	c := count(t, pool, s.Job)
	require.Equal(t, counts{Normalized: 1000, Events: 1000, DistinctEvents: 1000, Processed: 1000, States: "failed"}, c,
		"chunks 0 and 1 committed; 2 failed; 3 (written, in flight) rolled back")
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source_id::bigint >= 7000`))
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM outbox_events WHERE aggregate_id::bigint >= 7000`))
	var cursor []string
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT cursor FROM batch_runs WHERE job = $1`, s.Job).Scan(&cursor))
	require.Equal(t, "6993", cursor[len(cursor)-1], "the checkpoint is the last row of chunk 1")

	p.fail.Store(false)
	sum, err := run(t, pool, s, batch.Config{Processor: p})
	require.NoError(t, err)
	require.True(t, sum.Done)
	exact(t, url, s.Job, 3000)
}

// A pipelined run gives the same results as one chunk at a time, on both
// paths, and MaxChunks counts committed chunks even with two in flight.
func TestPipelineSameResults(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		pipeline  int
		processor bool
	}{
		{name: "sql one at a time", pipeline: 1},
		{name: "sql two in flight", pipeline: 2},
		{name: "go one at a time", pipeline: 1, processor: true},
		{name: "go two in flight", pipeline: 2, processor: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			url, pool := newDB(t)
			seed(t, pool, 0, 5003, 4, 1)
			s := spec(func(s *batch.Spec) { s.Chunk.Pipeline = tc.pipeline })
			cfg := batch.Config{MaxChunks: 3}
			if tc.processor {
				cfg.Processor = &failAfter{}
			}
			sum, err := run(t, pool, s, cfg)
			require.NoError(t, err)
			require.EqualValues(t, 3, sum.Chunks)
			require.Equal(t, counts{Normalized: 1500, Events: 1500, DistinctEvents: 1500, Processed: 1500, States: "pending"}, count(t, pool, s.Job))
			cfg.MaxChunks = 0
			sum, err = run(t, pool, s, cfg)
			require.NoError(t, err)
			require.True(t, sum.Done)
			require.EqualValues(t, 8, sum.Chunks) // 3500 rows: 7 full chunks and the 3 left
			exact(t, url, s.Job, 5003)
		})
	}
}
