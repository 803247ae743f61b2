package batch_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
)

// A text cursor column with its own collation (here ICU English, where
// "a" < "B" < "c"; the database's default C.UTF-8 puts "B" before "a") is
// scanned in that order, and the checkpoint's checks (forward, within the
// boundary) compare in the same order.
func TestCursorComparesInTheColumnsCollation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := newDB(t)
	_, err := pool.Exec(ctx, `CREATE TABLE icu_records (id text COLLATE "en-x-icu" PRIMARY KEY, version bigint NOT NULL DEFAULT 1)`)
	require.NoError(t, err)
	// a B c D e F ... : alternating case, so the two orders differ.
	_, err = pool.Exec(ctx, `INSERT INTO icu_records (id) SELECT CASE WHEN g % 2 = 0 THEN chr(97 + g) ELSE chr(65 + g) END || 'x' || lpad(k::text, 2, '0') FROM generate_series(0, 25) g, generate_series(0, 3) k`)
	require.NoError(t, err)
	s := batch.Spec{Job: "icu", ProcessorVersion: "v1",
		Source: batch.Source{Table: "icu_records", Cursor: []string{"id"}, ID: "id", Version: "version"},
		Chunk:  batch.ChunkSettings{Size: 5, Min: 5, Max: 5}}
	sum, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.True(t, sum.Done)
	require.EqualValues(t, 104, sum.Rows)
	require.EqualValues(t, 104, queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source = 'icu_records'`))
}

// Cursors are stored as text. A session with a non-ISO DateStyle
// ("SQL, DMY": 14/05/2025) must not store cursors that a session with
// another one ("SQL, MDY") reads as other dates, or cannot read at all.
func TestCursorTextIndependentOfDateStyle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := newDB(t)
	seed(t, pool, 0, 1000, 1, 1)
	// One row a day: the day of month goes past 12.
	_, err := pool.Exec(ctx, `UPDATE source_records SET created_at = timestamptz '2024-01-01 00:00:00+00' + (id / 7) * interval '1 day'`)
	require.NoError(t, err)
	withDateStyle := func(style string) *pgxpool.Pool {
		cfg, err := pgxpool.ParseConfig(url)
		require.NoError(t, err)
		cfg.ConnConfig.RuntimeParams["DateStyle"] = style
		p, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(p.Close)
		return p
	}
	s := spec()
	_, err = run(t, withDateStyle("SQL, DMY"), s, batch.Config{MaxChunks: 1})
	require.NoError(t, err)
	require.EqualValues(t, 500, count(t, pool, s.Job).Processed)

	sum, err := run(t, withDateStyle("SQL, MDY"), s, batch.Config{})
	require.NoError(t, err)
	require.True(t, sum.Done)
	exact(t, url, s.Job, 1000)
}

// A filter value that does not cast to its column's type is an error in
// the spec: it names the filter and wraps ErrSpec (the CLI exits 2).
func TestFilterValueMustCastToTheColumn(t *testing.T) {
	t.Parallel()
	_, pool := newDB(t)
	seed(t, pool, 0, 10, 1, 1)
	for _, tc := range []struct {
		name string
		cond batch.Condition
		want string
	}{
		{name: "value", cond: batch.Condition{Column: "created_at", Op: ">=", Value: "last tuesday"},
			want: `source.filter[0] (created_at >= "last tuesday"): the value is not a valid timestamp with time zone`},
		{name: "values", cond: batch.Condition{Column: "version", Op: "in", Values: []string{"1", "two"}},
			want: `source.filter[0] (version in ["1" "two"]): the value is not a valid bigint`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := spec(func(s *batch.Spec) { s.Source.Filter = []batch.Condition{tc.cond} })
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			r, err := batch.NewRunner(pool, s, batch.Config{})
			require.NoError(t, err)
			_, err = r.Prepare(ctx)
			require.ErrorIs(t, err, batch.ErrSpec)
			require.ErrorContains(t, err, tc.want)
		})
	}
}
