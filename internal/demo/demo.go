// Package demo seeds and changes the demo source table (source_records, see
// batch.DemoSchemaSQL) for `make demo`, `batcher demo seed` and the
// end-to-end tests. All of it runs as set-based SQL inside the server.
package demo

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/batch"
)

// seedSQL inserts rows $1+1 .. $1+$2. Many rows share created_at (seven per
// second) so the cursor's tie-breaker matters, ids have gaps (3g for even g,
// 3g+1 for odd g, so max(id)/3 is the last g), payloads are
// about 500 bytes, and every $3-th row (0 = none) has no title, which the
// demo spec's normalizer refuses (quarantined).
const seedSQL = `
INSERT INTO source_records (id, created_at, tenant_id, payload)
SELECT g * 3 + (g % 2),
       timestamptz '2026-01-01 00:00:00+00' + ((g / 7) * interval '1 second'),
       'tenant-' || (g % 4),
       jsonb_build_object(
         'title', CASE WHEN $3 > 0 AND g % $3 = 0 THEN NULL ELSE '  Record ' || g || ' about ' || (ARRAY['kafka','postgres','search','outbox','batch'])[1 + g % 5] || '  ' END,
         'body', repeat(md5(g::text), 12),
         'tags', jsonb_build_array('t' || (g % 10), 't' || (g % 7)),
         'rank', g % 1000)
FROM generate_series($1::bigint + 1, $1::bigint + $2::bigint) AS g`

// SeedOptions tune Seed.
type SeedOptions struct {
	// Rows to insert. Required.
	Rows int
	// BadEvery makes every BadEvery-th row malformed (no title); 0 = none.
	BadEvery int
	// CommentEvery gives every CommentEvery-th new row two comments in
	// record_comments (nested in the demo job's documents); 0 = none.
	CommentEvery int
	// Progress, if set, is called after each batch with the rows so far.
	Progress func(done int)
}

// commentSQL gives every $3-th row of rows $1+1 .. $1+$2 (seedSQL's ids)
// two comments.
const commentSQL = `
INSERT INTO record_comments (record_id, author, body, created_at)
SELECT g * 3 + (g % 2), (ARRAY['ana','bo','chen','dara'])[1 + (g + c) % 4], 'Comment ' || c || ' on record ' || g,
       timestamptz '2026-01-02 00:00:00+00' + g * interval '1 second' + c * interval '1 minute'
FROM generate_series($1::bigint + 1, $1::bigint + $2::bigint) AS g, generate_series(1, 2) AS c
WHERE g % $3 = 0`

// Seed creates source_records when missing and inserts opts.Rows rows after
// the ones already there, in batches of 50,000.
func Seed(ctx context.Context, pool *pgxpool.Pool, opts SeedOptions) error {
	if opts.Rows <= 0 {
		return fmt.Errorf("rows must be > 0, got %d", opts.Rows)
	}
	// The schema script replaces the trigger, which locks the table against
	// writers: run it only when the table is missing, so seeding more rows
	// into a live table does not stall the batchers reading it.
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass('source_records') IS NOT NULL AND to_regclass('record_comments') IS NOT NULL`).Scan(&exists); err != nil {
		return fmt.Errorf("look for source_records: %w", err)
	}
	if !exists {
		if _, err := pool.Exec(ctx, batch.DemoSchemaSQL); err != nil {
			return fmt.Errorf("create source_records: %w", err)
		}
	}
	var start int64
	if err := pool.QueryRow(ctx, `SELECT coalesce(max(id) / 3, 0) FROM source_records`).Scan(&start); err != nil {
		return fmt.Errorf("read source_records: %w", err)
	}
	const step = 50_000
	for done := 0; done < opts.Rows; {
		n := min(step, opts.Rows-done)
		if _, err := pool.Exec(ctx, seedSQL, start+int64(done), n, opts.BadEvery); err != nil {
			return fmt.Errorf("seed rows %d..%d: %w", done, done+n, err)
		}
		if opts.CommentEvery > 0 {
			if _, err := pool.Exec(ctx, commentSQL, start+int64(done), n, opts.CommentEvery); err != nil {
				return fmt.Errorf("seed the comments of rows %d..%d: %w", done, done+n, err)
			}
		}
		done += n
		if opts.Progress != nil {
			opts.Progress(done)
		}
	}
	if _, err := pool.Exec(ctx, `ANALYZE source_records, record_comments`); err != nil {
		return fmt.Errorf("analyze source_records: %w", err)
	}
	return nil
}

// Changes says what Mutate did.
type Changes struct {
	Updated, Deleted int64
}

// Mutate changes about every updateEvery-th live row (a new title, so the
// trigger bumps version and change_seq) and soft-deletes about every
// deleteEvery-th live row; 0 disables either. salt varies which rows.
func Mutate(ctx context.Context, pool *pgxpool.Pool, updateEvery, deleteEvery, salt int) (Changes, error) {
	var c Changes
	if updateEvery > 0 {
		tag, err := pool.Exec(ctx, `
UPDATE source_records
SET payload = payload || jsonb_build_object('title', 'Updated record ' || id || ' (edit ' || version + 1 || ')')
WHERE deleted_at IS NULL AND abs(hashtext(id::text || ':u' || $2::int)) % $1 = 0 AND payload->>'title' IS NOT NULL`, updateEvery, salt)
		if err != nil {
			return c, fmt.Errorf("update rows: %w", err)
		}
		c.Updated = tag.RowsAffected()
	}
	if deleteEvery > 0 {
		tag, err := pool.Exec(ctx, `
UPDATE source_records SET deleted_at = clock_timestamp()
WHERE deleted_at IS NULL AND abs(hashtext(id::text || ':d' || $2::int)) % $1 = 0`, deleteEvery, salt)
		if err != nil {
			return c, fmt.Errorf("soft-delete rows: %w", err)
		}
		c.Deleted = tag.RowsAffected()
	}
	return c, nil
}
