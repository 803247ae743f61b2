package batch_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/failpoint"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// randomSeedEnv replays TestRandomizedRunsMatchTheModel with a seed it
// printed; randomDurationEnv sets how long its chaos phase lasts (Go
// duration, default 20s).
const (
	randomSeedEnv     = "OUTBOXRELAY_RANDOM_SEED"
	randomDurationEnv = "OUTBOXRELAY_RANDOM_DURATION"
)

type randRow struct {
	version int64
	deleted bool
	title   string
}

// Many short runs of the real batcher over a table with random text keys,
// while rows are inserted, updated and soft-deleted at random places (also
// below the cursor and the boundary), with chunks forced to roll back and
// retry (failpoint batch.chunk_error) and processes killed at failpoints
// or at random moments. Then the changes stop, and runs (still under
// chaos, while new rows keep arriving) go on until one that started after
// the last change has succeeded: normalized_records must then hold every
// row at its last version with the document a model computes in Go from
// the source rows, and the outbox one event per (row, version).
//
// The choices come from a seed it prints; set OUTBOXRELAY_RANDOM_SEED to
// replay them (the timing of the processes still varies).
func TestRandomizedRunsMatchTheModel(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv(randomSeedEnv); v != "" {
		var err error
		seed, err = strconv.ParseUint(v, 10, 64)
		require.NoError(t, err, randomSeedEnv)
	}
	chaosFor := 20 * time.Second
	if v := os.Getenv(randomDurationEnv); v != "" {
		var err error
		chaosFor, err = time.ParseDuration(v)
		require.NoError(t, err, randomDurationEnv)
	}
	t.Logf("seed %d (replay with %s=%d)", seed, randomSeedEnv, seed)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("FAILED with seed %d: replay with %s=%d", seed, randomSeedEnv, seed)
		}
	})
	rng := rand.New(rand.NewPCG(seed, 1))
	ctx := context.Background()
	bin := testproc.Build(t, "batcher")
	url, pool := newDB(t)
	_, err := pool.Exec(ctx, `CREATE TABLE rand_records (id text PRIMARY KEY, version bigint NOT NULL DEFAULT 1, deleted boolean NOT NULL DEFAULT false, title text NOT NULL, late boolean NOT NULL DEFAULT false)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE FUNCTION rand_records_bump() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW IS DISTINCT FROM OLD THEN NEW.version := OLD.version + 1; END IF;
    RETURN NEW;
END $$`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE TRIGGER rand_records_bump BEFORE UPDATE ON rand_records FOR EACH ROW EXECUTE FUNCTION rand_records_bump()`)
	require.NoError(t, err)
	size := 20 + rng.IntN(60)
	m := &mutator{pool: pool, rng: rand.New(rand.NewPCG(seed, 2)), ahead: size}
	require.NoError(t, m.insert(ctx, 1500, false))

	s := batch.Spec{
		Job:              "random",
		ProcessorVersion: "v1",
		Source:           batch.Source{Table: "rand_records", Cursor: []string{"id"}, ID: "id", Version: "version", Deleted: "deleted"},
		Document:         batch.Document{Fields: []batch.Field{{Name: "id"}, {Name: "title", Transforms: []string{"trim"}}}},
		Chunk:            batch.ChunkSettings{Size: size, Min: size, Max: size, Pipeline: 1 + rng.IntN(3), LockTimeout: batch.Duration(time.Second)},
		Errors:           batch.ErrorPolicy{Policy: batch.PolicyStrict, MaxRetries: 10, InitialBackoff: batch.Duration(100 * time.Millisecond), MaxBackoff: batch.Duration(500 * time.Millisecond)},
	}
	t.Logf("chunk size %d, pipeline %d", s.Chunk.Size, s.Chunk.Pipeline)
	specFile := writeSpec(t, s)

	// One batcher process under chaos; it returns once the process ended.
	points := []string{"batch.before_tx", "batch.after_upsert", "batch.after_checkpoint", "batch.after_commit"}
	process := func(final bool) {
		t.Helper()
		var fp []string
		var killAfter time.Duration
		if final {
			// Retries while rows arrive inside the chunks' ranges.
			for range 3 {
				fp = append(fp, fmt.Sprintf("batch.chunk_error@%d", 1+rng.IntN(20)))
			}
		}
		switch rng.IntN(4) {
		case 0: // a clean process
		case 1:
			for range 1 + rng.IntN(3) {
				fp = append(fp, fmt.Sprintf("batch.chunk_error@%d", 1+rng.IntN(6)))
			}
		case 2:
			fp = append(fp, fmt.Sprintf("%s@%d", points[rng.IntN(len(points))], 1+rng.IntN(6)))
			if rng.IntN(2) == 0 {
				fp = append(fp, fmt.Sprintf("batch.chunk_error@%d", 1+rng.IntN(3)))
			}
		case 3:
			killAfter = time.Duration(50+rng.IntN(700)) * time.Millisecond
		}
		p := testproc.Start(t, bin, env(url, failpoint.EnvVar+"="+strings.Join(fp, ","), crashLease), "run", "--spec", specFile)
		if killAfter > 0 {
			select {
			case <-p.Done():
			case <-time.After(killAfter): // a kill at a random moment
				_ = p.Signal(syscall.SIGKILL)
			}
		}
		if err := p.Wait(2 * time.Minute); err != nil && !p.Killed() && p.ExitCode() < 0 {
			t.Fatalf("batcher did not end: %v\nstderr:\n%s", err, p.Stderr())
		}
		if !p.Killed() {
			require.Equal(t, 0, p.ExitCode(), "failpoints %v; stderr:\n%s", fp, p.Stderr())
		}
	}

	// Chaos: changes everywhere while runs come and go.
	mctx, stopChanges := context.WithCancel(ctx)
	changes := m.run(mctx, false)
	t.Cleanup(stopChanges)
	processes := 0
	for deadline := time.Now().Add(chaosFor); time.Now().Before(deadline); processes++ {
		process(false)
	}
	stopChanges()
	require.NoError(t, <-changes)
	var quiet time.Time
	require.NoError(t, pool.QueryRow(ctx, `SELECT now()`).Scan(&quiet))
	model := map[string]randRow{}
	rows, err := pool.Query(ctx, `SELECT id, version, deleted, title FROM rand_records`)
	require.NoError(t, err)
	var (
		id string
		r  randRow
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &r.version, &r.deleted, &r.title}, func() error { model[id] = r; return nil })
	require.NoError(t, err)

	// Then only new rows arrive (many of them right ahead of the running
	// cursor, inside the ranges of chunks in flight), and the runs go on
	// until three that started after the last change succeeded; each of
	// them must leave the model's rows complete.
	lctx, stopLate := context.WithCancel(ctx)
	late := m.run(lctx, true)
	t.Cleanup(stopLate)
	for i, checked := 0, int64(0); checked < 3; i++ {
		require.Less(t, i, 60, "three runs started after the changes stopped have not succeeded")
		process(true)
		processes++
		if n := queryInt(t, pool, `SELECT count(*) FROM batch_runs WHERE job = 'random' AND state = 'succeeded' AND created_at > $1`, quiet); n > checked {
			checked = n
			checkModel(t, pool, model)
		}
	}
	stopLate()
	require.NoError(t, <-late)
	t.Logf("%d processes, %d runs, %d chunk retries, %d rows (%d late)", processes, queryInt(t, pool, `SELECT count(DISTINCT logical_run_id) FROM batch_runs`),
		queryInt(t, pool, `SELECT COALESCE(sum(retries), 0) FROM batch_runs`),
		queryInt(t, pool, `SELECT count(*) FROM rand_records`), queryInt(t, pool, `SELECT count(*) FROM rand_records WHERE late`))

	checkModel(t, pool, model)
}

// checkModel compares normalized_records and the outbox with the model:
// every row of it at its version, deleted flag and document (trimmed
// title); late rows, if already processed, at version 1; nothing else; one
// event per (row, version), and one for every normalized row's version.
func checkModel(t *testing.T, pool *pgxpool.Pool, model map[string]randRow) {
	t.Helper()
	ctx := context.Background()
	lateRows := map[string]string{}
	rows, err := pool.Query(ctx, `SELECT id, title FROM rand_records WHERE late`)
	require.NoError(t, err)
	var id, title string
	_, err = pgx.ForEachRow(rows, []any{&id, &title}, func() error { lateRows[id] = title; return nil })
	require.NoError(t, err)

	type got struct {
		version  int64
		deleted  bool
		docID    *string
		docTitle *string
	}
	norm := map[string]got{}
	rows, err = pool.Query(ctx, `SELECT source_id, source_version, deleted, document->>'id', document->>'title' FROM normalized_records WHERE source = 'rand_records'`)
	require.NoError(t, err)
	var g got
	_, err = pgx.ForEachRow(rows, []any{&id, &g.version, &g.deleted, &g.docID, &g.docTitle}, func() error { norm[id] = g; return nil })
	require.NoError(t, err)

	var problems []string
	for id, want := range model {
		g, ok := norm[id]
		switch {
		case !ok:
			problems = append(problems, fmt.Sprintf("row %s (version %d) never normalized", id, want.version))
		case g.version != want.version || g.deleted != want.deleted:
			problems = append(problems, fmt.Sprintf("row %s: normalized at version %d deleted %v, source has %d deleted %v", id, g.version, g.deleted, want.version, want.deleted))
		case !want.deleted && (g.docID == nil || *g.docID != id || g.docTitle == nil || *g.docTitle != strings.TrimSpace(want.title)):
			problems = append(problems, fmt.Sprintf("row %s: document id %v title %v, want %q", id, deref(g.docID), deref(g.docTitle), strings.TrimSpace(want.title)))
		}
	}
	for id, g := range norm {
		if _, ok := model[id]; ok {
			continue
		}
		title, ok := lateRows[id]
		switch {
		case !ok:
			problems = append(problems, fmt.Sprintf("normalized row %s is not in the source", id))
		case g.version != 1 || g.deleted || g.docTitle == nil || *g.docTitle != strings.TrimSpace(title):
			problems = append(problems, fmt.Sprintf("late row %s: version %d deleted %v title %v", id, g.version, g.deleted, deref(g.docTitle)))
		}
	}
	if len(problems) > 10 {
		problems = append(problems[:10], fmt.Sprintf("... and %d more", len(problems)-10))
	}
	require.Empty(t, problems, "normalized_records differs from the model")

	require.Zero(t, queryInt(t, pool, `SELECT count(*) - count(DISTINCT (aggregate_id, aggregate_version)) FROM outbox_events`), "one event per (row, version)")
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM normalized_records n LEFT JOIN outbox_events e ON e.aggregate_id = n.source_id AND e.aggregate_version = n.source_version WHERE e.id IS NULL`),
		"every normalized version has its event")
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM outbox_events e JOIN normalized_records n ON n.source_id = e.aggregate_id AND n.source_version = e.aggregate_version
WHERE (e.event_type = 'delete') <> n.deleted`), "delete events for deleted rows, upserts for the others")
}

func deref(s *string) any {
	if s == nil {
		return nil
	}
	return *s
}

// mutator changes rand_records at random places: inserts with random text
// keys, title updates and soft deletes of random rows, in short
// transactions that sometimes stay open a moment.
type mutator struct {
	pool  *pgxpool.Pool
	ahead int // how far ahead of the running cursor to insert, in rows
	mu    sync.Mutex
	rng   *rand.Rand
}

func (m *mutator) intN(n int) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.rng.IntN(n)
}

func (m *mutator) key() string {
	const letters = "abcdefghijklmnopqrstuvwxyz0123456789"
	m.mu.Lock()
	defer m.mu.Unlock()
	b := make([]byte, 10)
	for i := range b {
		b[i] = letters[m.rng.IntN(len(letters))]
	}
	return string(b)
}

func (m *mutator) insert(ctx context.Context, n int, late bool) error {
	ids := make([]string, n)
	titles := make([]string, n)
	for i := range ids {
		ids[i], titles[i] = m.key(), fmt.Sprintf("  title %d  ", m.intN(1_000_000))
	}
	_, err := m.pool.Exec(ctx, `INSERT INTO rand_records (id, title, late) SELECT * , $3::boolean FROM unnest($1::text[], $2::text[]) ON CONFLICT DO NOTHING`, ids, titles, late)
	return err
}

// run changes rows until ctx ends (only inserts of late rows when late is
// set) and sends the first error, or nil, once it stopped.
func (m *mutator) run(ctx context.Context, late bool) <-chan error {
	done := make(chan error, 1)
	go func() {
		for ctx.Err() == nil {
			op := m.intN(4) // 0: insert at random places, 1: update, 2: soft delete, 3: insert next to a row
			if late {
				op = []int{0, 3}[m.intN(2)]
			}
			at := m.key() // a random place in the key order
			n := 1 + m.intN(5)
			hold := time.Duration(m.intN(30)) * time.Millisecond
			if late {
				hold += 20 * time.Millisecond // fewer new rows: the last runs stay short
			}
			err := pgx.BeginFunc(context.WithoutCancel(ctx), m.pool, func(tx pgx.Tx) error {
				var err error
				switch op {
				case 0:
					ids := make([]string, n)
					for i := range ids {
						ids[i] = m.key()
					}
					_, err = tx.Exec(ctx, `INSERT INTO rand_records (id, title, late) SELECT id, '  new ' || id || ' ', $2 FROM unnest($1::text[]) id ON CONFLICT DO NOTHING`, ids, late)
				case 1:
					_, err = tx.Exec(ctx, `UPDATE rand_records SET title = '  edited ' || version || ' ' WHERE id IN (SELECT id FROM rand_records WHERE id >= $1 AND NOT late ORDER BY id LIMIT $2)`, at, n)
				case 2:
					_, err = tx.Exec(ctx, `UPDATE rand_records SET deleted = true WHERE id IN (SELECT id FROM rand_records WHERE id >= $1 AND NOT late ORDER BY id LIMIT $2)`, at, n)
				case 3:
					// Right ahead of the running cursor: inside the ranges of
					// the chunks in flight, and of their retries.
					_, err = tx.Exec(ctx, `INSERT INTO rand_records (id, title, late)
SELECT r.id || '~' || lpad(g::text, 2, '0'), '  next to ' || r.id || ' ', $2
FROM (SELECT id FROM rand_records
      WHERE id > COALESCE((SELECT cursor[1] FROM batch_runs WHERE job = 'random' AND state = 'running' ORDER BY created_at DESC LIMIT 1), '')
      ORDER BY id OFFSET $3 LIMIT 1) r, generate_series(1, $1::int) g
ON CONFLICT DO NOTHING`, 3*n, late, m.intN(3*m.ahead))
				}
				if err == nil && hold > 0 {
					select { // a writer that stays open a moment
					case <-ctx.Done():
					case <-time.After(hold):
					}
				}
				return err
			})
			if err != nil && ctx.Err() == nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	return done
}
