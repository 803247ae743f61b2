package batch_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/failpoint"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// More tests of document.relations (issue #32) on the catalog of
// relations_test.go: each reads what a user would check, over the pool.

// relRun runs s once and returns the error of the start or of the run.
func relRun(t *testing.T, pool *pgxpool.Pool, s batch.Spec) (*batch.Summary, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	r, err := batch.NewRunner(pool, s, batch.Config{})
	if err != nil {
		return nil, err
	}
	return r.Run(ctx, ctx)
}

// relDocsOf reads the live documents of source over a new connection.
func relDocsOf(t *testing.T, pool *pgxpool.Pool, source string) map[string]string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT source_id, document::text FROM normalized_records WHERE source = $1 AND NOT deleted ORDER BY 1`, source)
	require.NoError(t, err)
	out := map[string]string{}
	for rows.Next() {
		var id, doc string
		require.NoError(t, rows.Scan(&id, &doc))
		out[id] = doc
	}
	require.NoError(t, rows.Err())
	return out
}

func mustExec(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	_, err := pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err, sql)
}

func mustRun(t *testing.T, pool *pgxpool.Pool, s batch.Spec, what string) *batch.Summary {
	t.Helper()
	sum, err := relRun(t, pool, s)
	require.NoError(t, err, what)
	require.True(t, sum.Done, what)
	return sum
}

// A flattened one_to_one relation merges its fields into its parent
// object, the root's or a related row's (nulls when there is no row), a
// scalar one_to_one is the field's value, a key from the catalog and the
// same key given explicitly join the same rows, a join with no key in the
// catalog works when given explicitly, and a one_to_many array keeps
// order_by desc and its limit; in full mode, with drop_nulls, and in an
// incremental job whose changes reach the roots through each of them.
func TestRelFlattenScalarKeysOrderAndLimit(t *testing.T) {
	t.Parallel()
	pool := newCatalog(t)
	mustExec(t, pool, `
CREATE TABLE product_details (product_id int PRIMARY KEY, color text, weight int); -- no foreign key in the catalog
INSERT INTO product_details VALUES (10, 'red', 5), (11, 'blue', NULL);
CREATE TABLE variant_stock (variant_id int PRIMARY KEY REFERENCES variants, qty int);
INSERT INTO variants VALUES (104, 10, 'A-M', 5, NULL);
INSERT INTO variant_stock VALUES (100, 7), (104, 0);`)
	s := catalogSpec(batch.ModeFull)
	s.Document.Relations = []batch.Relation{
		{Name: "brand", Table: "brands", Type: batch.OneToOne, Fields: []batch.Field{{Name: "name"}}},
		{Name: "brand_name", Table: "brands", Type: batch.OneToOne, Variant: batch.VariantScalar,
			ForeignKey: &batch.KeyPair{Parent: "brand_id", Child: "id"}, Fields: []batch.Field{{Name: "name", Transforms: []string{"lower"}}}},
		{Table: "product_details", Type: batch.OneToOne, Variant: batch.VariantFlatten,
			ForeignKey: &batch.KeyPair{Parent: "id", Child: "product_id"}, Fields: []batch.Field{{Name: "color"}, {Name: "weight"}}},
		{Name: "top_skus", Table: "variants", Type: batch.OneToMany, Variant: batch.VariantScalar, Deleted: "deleted_at",
			OrderBy: []string{"position desc"}, Limit: 2, Fields: []batch.Field{{Name: "sku"}}},
		{Name: "variants", Table: "variants", Type: batch.OneToMany, OrderBy: []string{"position DESC", "id"},
			Fields:    []batch.Field{{Name: "sku"}, {Name: "position"}},
			Relations: []batch.Relation{{Table: "variant_stock", Type: batch.OneToOne, Variant: batch.VariantFlatten, Fields: []batch.Field{{Name: "qty"}}}}},
	}
	mustRun(t, pool, s, "full run")
	d := relDocs(t, pool)
	require.Len(t, d, 3)
	// Variants of 10: 100 (position 2), 101 (1), 103 (3, soft-deleted:
	// only the relation with deleted leaves it out), 104 (5).
	jsonEq(t, `{"id":10,"name":"Anvil","brand":{"name":"Acme"},"brand_name":"acme","color":"red","weight":5,"top_skus":["A-M","A-S"],
	  "variants":[{"sku":"A-M","position":5,"qty":0},{"sku":"A-X","position":3,"qty":null},{"sku":"A-S","position":2,"qty":7},{"sku":"A-L","position":1,"qty":null}]}`, d["10"], "product 10")
	jsonEq(t, `{"id":11,"name":"Rocket","brand":{"name":"Acme"},"brand_name":"acme","color":"blue","weight":null,"top_skus":["R-1"],
	  "variants":[{"sku":"R-1","position":0,"qty":null}]}`, d["11"], "product 11")
	jsonEq(t, `{"id":12,"name":"Nut","brand":null,"brand_name":null,"color":null,"weight":null,"top_skus":[],"variants":[]}`, d["12"], "product 12: no brand, no details, no variants")

	// drop_nulls: the flattened keys of a missing row and a null scalar
	// are absent, nested nulls too.
	dn := s
	dn.Document.DropNulls = true
	dn.ProcessorVersion = "v2"
	mustRun(t, pool, dn, "full run, drop_nulls")
	d = relDocs(t, pool)
	jsonEq(t, `{"id":12,"name":"Nut","top_skus":[],"variants":[]}`, d["12"], "product 12, drop_nulls")
	jsonEq(t, `{"id":11,"name":"Rocket","brand":{"name":"Acme"},"brand_name":"acme","color":"blue","top_skus":["R-1"],"variants":[{"sku":"R-1","position":0}]}`, d["11"], "product 11, drop_nulls")

	// The same document in an incremental job: changes of the flattened
	// rows (root level and nested) and of the order reach their roots.
	inc := catalogSpec(batch.ModeIncremental)
	inc.Job, inc.SourceName = "products_inc", "products_inc"
	inc.Document.Relations = s.Document.Relations
	installCapture(t, pool, inc)
	mustRun(t, pool, inc, "first incremental run")
	mustExec(t, pool, `UPDATE product_details SET color = 'green' WHERE product_id = 10;
INSERT INTO product_details VALUES (12, 'black', 1);
DELETE FROM product_details WHERE product_id = 11;
UPDATE variants SET position = 9 WHERE id = 101;
INSERT INTO variant_stock VALUES (102, 3)`)
	mustRun(t, pool, inc, "incremental run after the changes")
	d = relDocsOf(t, pool, "products_inc")
	jsonEq(t, `{"id":10,"name":"Anvil","brand":{"name":"Acme"},"brand_name":"acme","color":"green","weight":5,"top_skus":["A-L","A-M"],
	  "variants":[{"sku":"A-L","position":9,"qty":null},{"sku":"A-M","position":5,"qty":0},{"sku":"A-X","position":3,"qty":null},{"sku":"A-S","position":2,"qty":7}]}`, d["10"], "product 10, incremental")
	jsonEq(t, `{"id":11,"name":"Rocket","brand":{"name":"Acme"},"brand_name":"acme","color":null,"weight":null,"top_skus":["R-1"],
	  "variants":[{"sku":"R-1","position":0,"qty":3}]}`, d["11"], "product 11, incremental: its details deleted")
	jsonEq(t, `{"id":12,"name":"Nut","brand":null,"brand_name":null,"color":"black","weight":1,"top_skus":[],"variants":[]}`, d["12"], "product 12, incremental")
	require.Equal(t, int64(3), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE source = 'products_inc' AND source_version = 2`), "each root once at version 2")
}

// A relation naming a missing table, column or key, or joining columns of
// types that cannot be compared, fails at start naming it, and nothing is
// written.
func TestRelErrorsAtStartNameWhatIsMissing(t *testing.T) {
	t.Parallel()
	pool := newCatalog(t)
	mustExec(t, pool, `CREATE TABLE product_details (product_id int PRIMARY KEY, color text)`)
	with := func(r batch.Relation) batch.Spec {
		s := catalogSpec(batch.ModeFull)
		s.Document.Relations = []batch.Relation{r}
		return s
	}
	brand := func(fk *batch.KeyPair) batch.Relation {
		return batch.Relation{Name: "brand", Table: "brands", Type: batch.OneToOne, ForeignKey: fk, Fields: []batch.Field{{Name: "name"}}}
	}
	cases := []struct {
		name  string
		spec  batch.Spec
		wants []string
	}{
		{"missing table", with(batch.Relation{Name: "maker", Table: "makers", Type: batch.OneToOne, Fields: []batch.Field{{Name: "name"}}}),
			[]string{"document.relations[maker]", "public.makers", "does not exist"}},
		{"missing child column", with(brand(&batch.KeyPair{Parent: "brand_id", Child: "brand_key"})),
			[]string{"document.relations[brand].foreign_key.child", `"brand_key"`, "public.brands"}},
		{"missing parent column", with(brand(&batch.KeyPair{Parent: "maker_id", Child: "id"})),
			[]string{"document.relations[brand].foreign_key.parent", `"maker_id"`, "public.products"}},
		{"missing field column", with(batch.Relation{Name: "brand", Table: "brands", Type: batch.OneToOne, Fields: []batch.Field{{Name: "slug"}}}),
			[]string{"document.relations[brand].fields[0].from", `"slug"`, "public.brands"}},
		{"missing through table", with(batch.Relation{Name: "categories", Table: "categories", Type: batch.OneToMany,
			Through: &batch.Through{Table: "product_tags"}, Fields: []batch.Field{{Name: "name"}}}),
			[]string{"document.relations[categories].through.table", "public.product_tags", "does not exist"}},
		{"no key in the catalog", with(batch.Relation{Name: "details", Table: "product_details", Type: batch.OneToOne, Fields: []batch.Field{{Name: "color"}}}),
			[]string{"document.relations[details]", "0 single-column foreign keys between public.products and public.product_details", "foreign_key"}},
		{"incomparable types", with(brand(&batch.KeyPair{Parent: "name", Child: "id"})),
			[]string{"document.relations[brand]", "cannot join public.products.name (text) with public.brands.id (integer)"}},
		{"missing nested table", with(batch.Relation{Name: "variants", Table: "variants", Type: batch.OneToMany, Fields: []batch.Field{{Name: "sku"}},
			Relations: []batch.Relation{{Name: "stock", Table: "stock", Type: batch.OneToMany, Fields: []batch.Field{{Name: "qty"}}}}}),
			[]string{"document.relations[variants].relations[stock]", "public.stock", "does not exist"}},
	}
	check := func(t *testing.T, s batch.Spec, wants []string) {
		t.Helper()
		_, err := relRun(t, pool, s)
		require.ErrorIs(t, err, batch.ErrSpec)
		for _, w := range wants {
			require.ErrorContains(t, err, w)
		}
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { check(t, tc.spec, tc.wants) })
	}

	// A second foreign key between products and brands: the catalog no
	// longer says which one; an explicit key still joins.
	mustExec(t, pool, `ALTER TABLE products ADD COLUMN maker_id int REFERENCES brands`)
	t.Run("two keys in the catalog", func(t *testing.T) {
		check(t, with(brand(nil)), []string{"document.relations[brand]", "2 single-column foreign keys between public.products and public.brands",
			"foreign_key: {parent: <column of public.products>, child: <column of public.brands>}"})
	})
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM normalized_records`), "nothing written by a refused start")
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM outbox_event_members`), "nothing written by a refused start")

	mustExec(t, pool, `UPDATE products SET maker_id = 2 WHERE id = 10`)
	mustRun(t, pool, with(brand(&batch.KeyPair{Parent: "maker_id", Child: "id"})), "explicit key among two")
	d := relDocs(t, pool)
	jsonEq(t, `{"name":"Bolt"}`, field(t, d["10"], "brand"), "10 joined on maker_id")
	jsonEq(t, `null`, field(t, d["11"], "brand"), "11 has no maker")
}

// quarantineSpec is the catalog with checks on the related rows: a
// required variant sku and a string price tier from a jsonb column.
func quarantineSpec(mode, policy string) batch.Spec {
	s := catalogSpec(mode)
	s.Errors.Policy = policy
	v := &s.Document.Relations[1]
	v.Fields = []batch.Field{{Name: "sku", Required: true, Type: "string"}}
	v.Relations = []batch.Relation{{Name: "prices", Table: "prices", Type: batch.OneToMany, OrderBy: []string{"currency"},
		Fields: []batch.Field{{Name: "currency"}, {Name: "tier", From: "meta.tier", Type: "string"}}}}
	return s
}

func openQuarantine(t *testing.T, pool *pgxpool.Pool) map[string]string {
	t.Helper()
	rows, err := batch.ListQuarantine(context.Background(), pool, "products", false)
	require.NoError(t, err)
	out := map[string]string{}
	for _, r := range rows {
		out[r.SourceID] = r.Code + ": " + r.Message
	}
	return out
}

// A bad related row quarantines its root with a message naming the
// relation and the row (two levels; a soft-deleted bad row is left out,
// check included); once fixed, a quarantine retry indexes the root.
func TestRelQuarantineNamesTheChildAndRetryIndexes(t *testing.T) {
	t.Parallel()
	pool := newCatalog(t)
	ctx := context.Background()
	mustExec(t, pool, `ALTER TABLE prices ADD COLUMN meta jsonb;
UPDATE variants SET sku = NULL WHERE id = 101;
UPDATE prices SET meta = '{"tier": 1}' WHERE id = 1002;   -- variant 102 of product 11
INSERT INTO variants VALUES (105, 12, NULL, 0, now());     -- soft-deleted: left out with its check`)
	s := quarantineSpec(batch.ModeFull, batch.PolicyQuarantine)
	mustRun(t, pool, s, "full run")
	q := openQuarantine(t, pool)
	require.Len(t, q, 2, "%v", q)
	require.Equal(t, "related_row: variants [id=101] field sku (sku) is missing", q["10"])
	require.Equal(t, "related_row: variants.prices [id=1002] field tier (meta.tier): want string, got number", q["11"])
	d := relDocs(t, pool)
	require.Equal(t, []string{"12"}, slices.Sorted(maps.Keys(d)), "only the good root is indexed")
	require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM outbox_event_members WHERE aggregate_id IN ('10', '11')`))

	// Strict: the run fails naming the first bad root, its relation and
	// its child row (another job, so nothing of the first is reused).
	strict := quarantineSpec(batch.ModeFull, batch.PolicyStrict)
	strict.Job, strict.SourceName = "products_strict", "products_strict"
	_, err := relRun(t, pool, strict)
	require.ErrorIs(t, err, batch.ErrBadRow)
	require.ErrorContains(t, err, "row id=10: related_row: variants [id=101] field sku (sku) is missing")
	require.Empty(t, relDocsOf(t, pool, "products_strict"), "the failed chunk wrote nothing")

	mustExec(t, pool, `UPDATE variants SET sku = 'A-L' WHERE id = 101; UPDATE prices SET meta = '{"tier": "gold"}' WHERE id = 1002`)
	res, err := batch.RetryQuarantine(ctx, pool, s, nil, batch.RetryOptions{})
	require.NoError(t, err)
	require.Equal(t, batch.RetryResult{Retried: 2, Resolved: 2}, res)
	require.Empty(t, openQuarantine(t, pool))
	d = relDocs(t, pool)
	jsonEq(t, `[{"sku":"A-L","prices":[]},{"sku":"A-S","prices":[{"currency":"EUR","tier":null},{"currency":"USD","tier":null}]}]`, field(t, d["10"], "variants"), "variants of 10")
	jsonEq(t, `[{"sku":"R-1","prices":[{"currency":"EUR","tier":"gold"}]}]`, field(t, d["11"], "variants"), "variants of 11")
	for _, id := range []string{"10", "11"} {
		v, typ := relEvents(t, pool, id)
		require.Equal(t, []int64{1}, v, id)
		require.Equal(t, []string{"upsert"}, typ, id)
	}
}

// In an incremental run, a child change that makes its root bad is found
// by the relation phase: quarantine keeps the root's last good document
// and names the child; the fix reaches the index on the next run.
// Strict fails the run naming the root, the relation and the child, keeps
// the work, and the run after the fix indexes it.
func TestRelQuarantineInTheRelationPhase(t *testing.T) {
	t.Parallel()
	for _, policy := range []string{batch.PolicyQuarantine, batch.PolicyStrict} {
		t.Run(policy, func(t *testing.T) {
			t.Parallel()
			pool := newCatalog(t)
			ctx := context.Background()
			mustExec(t, pool, `ALTER TABLE prices ADD COLUMN meta jsonb`)
			s := quarantineSpec(batch.ModeIncremental, policy)
			installCapture(t, pool, s)
			mustRun(t, pool, s, "first run")
			before := relDocs(t, pool)
			require.Len(t, before, 3)

			mustExec(t, pool, `UPDATE variants SET sku = NULL WHERE id = 102`) // product 11
			sum, err := relRun(t, pool, s)
			if policy == batch.PolicyStrict {
				require.ErrorIs(t, err, batch.ErrBadRow)
				require.ErrorContains(t, err, "row id=11: related_row: variants [id=102] field sku (sku) is missing")
				require.Equal(t, int64(1), queryInt(t, pool, `SELECT count(*) FROM batch_relation_work WHERE job = 'products' AND root_id = '11'`), "the work stays")
				require.Empty(t, openQuarantine(t, pool), "strict quarantines nothing")
			} else {
				require.NoError(t, err)
				require.True(t, sum.Done)
				require.Equal(t, map[string]string{"11": "related_row: variants [id=102] field sku (sku) is missing"}, openQuarantine(t, pool))
				require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM batch_relation_work`), "the quarantined root's work is consumed")
			}
			require.Equal(t, before, relDocs(t, pool), "the last good documents stay")
			v11, _ := relEvents(t, pool, "11")
			require.Equal(t, []int64{1}, v11, "no event for the bad root")

			mustExec(t, pool, `UPDATE variants SET sku = 'R-9' WHERE id = 102`)
			mustRun(t, pool, s, "run after the fix")
			d := relDocs(t, pool)
			jsonEq(t, `[{"sku":"R-9","prices":[{"currency":"EUR","tier":null}]}]`, field(t, d["11"], "variants"), "variants of 11")
			v11, _ = relEvents(t, pool, "11")
			require.Equal(t, []int64{1, 2}, v11, "one event for the fix")
			require.Zero(t, queryInt(t, pool, `SELECT count(*) FROM batch_relation_work`))
			if policy == batch.PolicyQuarantine {
				// The row stays listed until a retry finds it good; the
				// retry writes nothing new for an indexed document.
				res, err := batch.RetryQuarantine(ctx, pool, s, nil, batch.RetryOptions{})
				require.NoError(t, err)
				require.Equal(t, batch.RetryResult{Retried: 1, Resolved: 1}, res)
				require.Empty(t, openQuarantine(t, pool))
				v11, _ = relEvents(t, pool, "11")
				require.Equal(t, []int64{1, 2}, v11, "the retry of an indexed document emits nothing")
			}
		})
	}
}

// sharedBrandSQL adds n products (ids from 1000) of one new brand 3.
func sharedBrandSQL(n int) string {
	return fmt.Sprintf(`INSERT INTO brands VALUES (3, 'Crate');
INSERT INTO products (id, name, brand_id) SELECT g, 'p' || g, 3 FROM generate_series(1000, %d) g;
INSERT INTO variants (id, product_id, sku) SELECT g + 100000, g, 's' || g FROM generate_series(1000, %d) g;
ANALYZE`, 999+n, 999+n)
}

// A parent shared by 5,000 roots renamed: the next incremental run
// re-emits exactly those 5,000 documents at version + 1, in 10 chunks of
// 500, and every one holds the new name.
func TestRelSharedParentRenamedRebuildsInChunks(t *testing.T) {
	t.Parallel()
	pool := newCatalog(t)
	const n = 5000
	mustExec(t, pool, sharedBrandSQL(n))
	s := catalogSpec(batch.ModeIncremental)
	s.Chunk = batch.ChunkSettings{Size: 500, Min: 500, Max: 500}
	installCapture(t, pool, s)
	mustRun(t, pool, s, "first run")
	require.Equal(t, int64(n+3), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members`))

	mustExec(t, pool, `UPDATE brands SET name = 'Crate & Barrel' WHERE id = 3`)
	start := time.Now()
	sum := mustRun(t, pool, s, "run after the rename")
	t.Logf("a brand shared by %d products renamed: the incremental run took %s (chunk.size 500)", n, time.Since(start))

	require.Equal(t, int64(n), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members WHERE aggregate_version = 2`))
	require.Equal(t, int64(n), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members e JOIN products p ON p.id::text = e.aggregate_id
		WHERE e.aggregate_version = 2 AND e.event_type = 'upsert' AND p.brand_id = 3 AND e.payload->'brand'->>'name' = 'CRATE & BARREL'`),
		"one upsert at version 2 per product of the brand, with the new name")
	require.Equal(t, int64(2*n+3), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members`), "nothing else")
	require.Equal(t, int64(n), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE document->'brand'->>'name' = 'CRATE & BARREL' AND source_version = 2`))
	var chunks, rebuilt, changed int64
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT chunks, rebuilt_count, rebuilt_changed FROM batch_sweeps WHERE job = 'products' AND logical_run_id = $1`, sum.RunID).
		Scan(&chunks, &rebuilt, &changed))
	require.Equal(t, []int64{10, n, n}, []int64{chunks, rebuilt, changed}, "chunks, rebuilt, changed")
	require.Zero(t, queryInt(t, pool, `SELECT (SELECT count(*) FROM batch_relation_changes) + (SELECT count(*) FROM batch_relation_work)`))
}

// Full mode needs no capture triggers: a child change reaches its root on
// the next full run at version + 1 (the root row's own version did not
// change), and the roots whose documents did not change get no event.
func TestRelFullModeWithoutTriggers(t *testing.T) {
	t.Parallel()
	pool := newCatalog(t)
	s := catalogSpec(batch.ModeFull)
	mustRun(t, pool, s, "first run")
	mustRun(t, pool, s, "a run with nothing changed")
	for _, id := range []string{"10", "11", "12"} {
		v, _ := relEvents(t, pool, id)
		require.Equal(t, []int64{1}, v, "an unchanged document emits nothing: %s", id)
	}

	mustExec(t, pool, `UPDATE prices SET amount = 7 WHERE id = 1002`) // variant 102 of product 11
	mustRun(t, pool, s, "run after the child change")
	d := relDocs(t, pool)
	jsonEq(t, `[{"sku":"R-1","prices":[{"currency":"EUR","amount":7}]}]`, field(t, d["11"], "variants"), "variants of 11")
	v11, t11 := relEvents(t, pool, "11")
	require.Equal(t, []int64{1, 2}, v11)
	require.Equal(t, []string{"upsert", "upsert"}, t11)
	require.Equal(t, int64(1), queryInt(t, pool, `SELECT version FROM products WHERE id = 11`), "the root row did not change")
	require.Equal(t, int64(2), queryInt(t, pool, `SELECT source_version FROM normalized_records WHERE source_id = '11'`))
	for _, id := range []string{"10", "12"} {
		v, _ := relEvents(t, pool, id)
		require.Equal(t, []int64{1}, v, "root %s did not change", id)
	}

	// The root row itself changes afterwards: its version 2 plus the
	// offset, above the version the child change took.
	mustExec(t, pool, `UPDATE products SET name = 'Rocket 2' WHERE id = 11`)
	mustRun(t, pool, s, "run after the root change")
	v11, _ = relEvents(t, pool, "11")
	require.Equal(t, []int64{1, 2, 3}, v11)
	jsonEq(t, `"Rocket 2"`, field(t, relDocs(t, pool)["11"], "name"), "name of 11")
}

// The chunk statement reads the related rows through the indexes on the
// child keys, and the resolution of captures through the join table's
// index, as the planner picks them for a catalog of realistic size.
func TestRelPlansUseTheChildKeyIndexes(t *testing.T) {
	t.Parallel()
	pool := newCatalog(t)
	ctx := context.Background()
	mustExec(t, pool, `
INSERT INTO brands SELECT g, 'b' || g FROM generate_series(3, 200) g;
INSERT INTO categories SELECT g, 'c' || g FROM generate_series(3, 500) g;
INSERT INTO products (id, name, brand_id) SELECT g, 'p' || g, 1 + g % 200 FROM generate_series(1000, 10999) g;
INSERT INTO variants (id, product_id, sku, position) SELECT 100000 + g, 1000 + g / 2, 's' || g, g % 2 FROM generate_series(0, 19999) g;
INSERT INTO prices SELECT 200000 + g, 100000 + g / 2, CASE WHEN g % 2 = 0 THEN 'EUR' ELSE 'USD' END, g FROM generate_series(0, 39999) g;
INSERT INTO product_categories SELECT 1000 + g / 2, 1 + (g * 7) % 500 FROM generate_series(0, 19999) g ON CONFLICT DO NOTHING;
ANALYZE`)
	s := catalogSpec(batch.ModeIncremental)
	s.Chunk = batch.ChunkSettings{Size: 500, Min: 500, Max: 500}
	installCapture(t, pool, s)
	// A few captures, as a run finds them: a renamed category.
	mustExec(t, pool, `UPDATE categories SET name = name || '!' WHERE id IN (7, 8); ANALYZE batch_relation_changes`)
	// And a queue of work as a follower's run finds it: autovacuum last saw
	// the queue empty (the run before drained it), then a run queued 600
	// roots.
	mustExec(t, pool, `VACUUM ANALYZE batch_relation_work`)
	mustExec(t, pool, `INSERT INTO batch_relation_work (job, root_id) SELECT 'products', g::text FROM generate_series(1000, 1599) g`)

	plans, err := batch.RelationPlans(ctx, pool, s)
	require.NoError(t, err)
	for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
		want := func(what string, index ...string) {
			t.Helper()
			plan := plans[mode+" "+what]
			used := batch.PlanIndexes(t, plan)
			for _, ix := range index {
				if !slices.Contains(used, ix) {
					t.Fatalf("%s, %s: no index scan of %s; indexes scanned: %v; plan:\n%s", mode, what, ix, used, plan)
				}
			}
		}
		want("chunk", "variants_product_id_idx", "prices_variant_id_idx", "product_categories_pkey")
		want("work", "variants_product_id_idx", "prices_variant_id_idx", "product_categories_pkey")
		want("resolve", "product_categories_category_id_idx")
		// Taking a chunk of work deletes the rows it locked: no join that
		// compares each taken root with every queued one (quadratic in the
		// queue: a 10,000-product brand rename in chunks of 2,000 spent most
		// of its time there), whatever the queue's statistics say.
		take := plans[mode+" take"]
		require.Empty(t, batch.PlanJoinFilters(t, take), "%s, take:\n%s", mode, take)
		require.Contains(t, take, `"Node Type": "Tid Scan"`, "%s, take: the taken rows are deleted by ctid", mode)
	}
}

// A kill -9 in the relation phase (after a chunk's documents and events
// are written but not committed, or right after a commit) loses nothing
// and duplicates nothing: the rerun rebuilds the roots still queued, each
// root has exactly one event for the change, and no work is left.
func TestRelKilledInTheRelationPhase(t *testing.T) {
	t.Parallel()
	bin := testproc.Build(t, "batcher")
	for _, point := range []string{"batch.relations_after_upsert", "batch.relations_after_commit"} {
		t.Run(point, func(t *testing.T) {
			t.Parallel()
			pool := newCatalog(t)
			url := pool.Config().ConnString()
			const n = 2000
			mustExec(t, pool, sharedBrandSQL(n))
			s := catalogSpec(batch.ModeIncremental)
			s.Chunk = batch.ChunkSettings{Size: 500, Min: 500, Max: 500}
			installCapture(t, pool, s)
			mustRun(t, pool, s, "first run")
			mustExec(t, pool, `UPDATE brands SET name = 'Crate & Barrel' WHERE id = 3`)

			specFile := writeSpec(t, s)
			p := testproc.Run(t, 2*time.Minute, bin, env(url, failpoint.EnvVar+"="+point+"@2", crashLease), "run", "--spec", specFile)
			require.True(t, p.Killed(), "killed at %s; stderr:\n%s", point, p.Stderr())
			require.Contains(t, p.Stderr(), "failpoint "+point)
			committed := int64(500) // the first chunk; the second's commit is lost or made
			if point == "batch.relations_after_commit" {
				committed = 1000
			}
			require.Equal(t, committed, queryInt(t, pool, `SELECT count(*) FROM outbox_event_members WHERE aggregate_version = 2`), "events of the committed chunks")
			require.Equal(t, n-committed, queryInt(t, pool, `SELECT count(*) FROM batch_relation_work`), "work of the chunks not committed")
			require.Equal(t, committed, queryInt(t, pool, `SELECT rebuilt_count FROM batch_sweeps WHERE job = 'products'`))

			p = testproc.Run(t, 2*time.Minute, bin, env(url, crashLease), "run", "--spec", specFile)
			require.Equal(t, 0, p.ExitCode(), p.Stderr())

			require.Equal(t, int64(n), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members WHERE aggregate_version = 2`), "one event per root for the change")
			require.Equal(t, int64(n), queryInt(t, pool, `SELECT count(DISTINCT aggregate_id) FROM outbox_event_members WHERE aggregate_version = 2 AND event_type = 'upsert'
				AND payload->'brand'->>'name' = 'CRATE & BARREL'`))
			require.Equal(t, queryInt(t, pool, `SELECT count(*) FROM outbox_event_members`), queryInt(t, pool, `SELECT count(DISTINCT (aggregate_id, aggregate_version)) FROM outbox_event_members`), "no duplicate event")
			require.Equal(t, int64(n+3), queryInt(t, pool, `SELECT count(*) FROM outbox_event_members WHERE aggregate_version = 1`))
			require.Equal(t, int64(n), queryInt(t, pool, `SELECT count(*) FROM normalized_records WHERE document->'brand'->>'name' = 'CRATE & BARREL' AND source_version = 2`))
			require.Zero(t, queryInt(t, pool, `SELECT (SELECT count(*) FROM batch_relation_changes) + (SELECT count(*) FROM batch_relation_work)`))
			require.Equal(t, int64(n), queryInt(t, pool, `SELECT sum(rebuilt_count) FROM batch_sweeps WHERE job = 'products'`), "every root rebuilt once")
		})
	}
}

// Two jobs over the same tables, each with its own source name and
// capture triggers: each job's runs see every change (the captures are
// per job; one job's run does not consume the other's).
func TestRelTwoJobsOnTheSameTables(t *testing.T) {
	t.Parallel()
	pool := newCatalog(t)
	a := catalogSpec(batch.ModeIncremental)
	b := catalogSpec(batch.ModeIncremental)
	b.Job, b.SourceName = "products_b", "products_b"
	b.Document.Relations = b.Document.Relations[:2] // brand and variants
	installCapture(t, pool, a)
	installCapture(t, pool, b)
	mustRun(t, pool, a, "first run of a")
	mustRun(t, pool, b, "first run of b")

	mustExec(t, pool, `UPDATE brands SET name = 'Acme Corp' WHERE id = 1; UPDATE prices SET amount = 1 WHERE id = 1002`)
	require.Equal(t, int64(2), queryInt(t, pool, `SELECT count(DISTINCT job) FROM batch_relation_changes`), "one capture per job")
	mustRun(t, pool, a, "a after the change")
	mustExec(t, pool, `UPDATE categories SET name = 'Hardware' WHERE id = 1`) // a's only
	mustRun(t, pool, b, "b after the change")
	mustRun(t, pool, a, "a after the category change")

	for _, src := range []string{"products", "products_b"} {
		d := relDocsOf(t, pool, src)
		require.Len(t, d, 3, src)
		jsonEq(t, `{"name":"ACME CORP"}`, field(t, d["10"], "brand"), src+": brand of 10")
		jsonEq(t, `{"name":"ACME CORP"}`, field(t, d["11"], "brand"), src+": brand of 11")
		jsonEq(t, `[{"sku":"R-1","prices":[{"currency":"EUR","amount":1}]}]`, field(t, d["11"], "variants"), src+": variants of 11")
	}
	jsonEq(t, `["Hardware"]`, field(t, relDocsOf(t, pool, "products")["11"], "categories"), "categories of 11")
	require.NotContains(t, relDocsOf(t, pool, "products_b")["11"], "categories")
	// Per job: 10 and 11 changed once (brand, then the category for a),
	// 12 never.
	vers := func(src, id string) []int64 {
		rows, err := pool.Query(context.Background(), `SELECT source_version FROM normalized_records WHERE source = $1 AND source_id = $2`, src, id)
		require.NoError(t, err)
		var out []int64
		for rows.Next() {
			var v int64
			require.NoError(t, rows.Scan(&v))
			out = append(out, v)
		}
		require.NoError(t, rows.Err())
		return out
	}
	require.Equal(t, []int64{3}, vers("products", "11"))
	require.Equal(t, []int64{2}, vers("products_b", "11"))
	require.Equal(t, []int64{1}, vers("products_b", "12"))
	// The events of 11: job a's documents have categories, b's have not.
	var evA, evB []int64
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT
		COALESCE(array_agg(aggregate_version ORDER BY id) FILTER (WHERE payload::jsonb ? 'categories'), '{}'),
		COALESCE(array_agg(aggregate_version ORDER BY id) FILTER (WHERE NOT payload::jsonb ? 'categories'), '{}')
		FROM outbox_event_members WHERE aggregate_id = '11'`).Scan(&evA, &evB))
	require.Equal(t, []int64{1, 2, 3}, evA, "events of 11 from job a")
	require.Equal(t, []int64{1, 2}, evB, "events of 11 from job b")
	require.Zero(t, queryInt(t, pool, `SELECT (SELECT count(*) FROM batch_relation_changes) + (SELECT count(*) FROM batch_relation_work)`))
}

// A root quarantined by the relation phase of a partitioned job is
// retried like any other: once its child is fixed, a quarantine retry
// indexes it and resolves it.
func TestRelQuarantineRetryInAPartitionedJob(t *testing.T) {
	t.Parallel()
	for _, col := range []string{"region text NOT NULL DEFAULT 'eu'", "shard int NOT NULL DEFAULT 7"} {
		name, _, _ := strings.Cut(col, " ")
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool := newCatalog(t)
			ctx := context.Background()
			mustExec(t, pool, `ALTER TABLE prices ADD COLUMN meta jsonb; ALTER TABLE products ADD COLUMN `+col)
			s := quarantineSpec(batch.ModeIncremental, batch.PolicyQuarantine)
			s.Source.Partition = name
			installCapture(t, pool, s)
			mustRun(t, pool, s, "first run")

			mustExec(t, pool, `UPDATE variants SET sku = NULL WHERE id = 102`) // product 11
			mustRun(t, pool, s, "run with the bad child")
			require.Equal(t, map[string]string{"11": "related_row: variants [id=102] field sku (sku) is missing"}, openQuarantine(t, pool))

			mustExec(t, pool, `UPDATE variants SET sku = 'R-9' WHERE id = 102`)
			res, err := batch.RetryQuarantine(ctx, pool, s, nil, batch.RetryOptions{})
			require.NoError(t, err)
			require.Equal(t, batch.RetryResult{Retried: 1, Resolved: 1}, res)
			require.Empty(t, openQuarantine(t, pool))
			jsonEq(t, `[{"sku":"R-9","prices":[{"currency":"EUR","tier":null}]}]`, field(t, relDocs(t, pool)["11"], "variants"), "variants of 11 after the retry")
			v11, _ := relEvents(t, pool, "11")
			require.Equal(t, []int64{1, 2}, v11)
		})
	}
}

// The checks of a relation's fields apply to the rows in the document: a
// bad row that order_by and limit (or one_to_one) leave out of it does
// not quarantine its root; a bad row in the document does.
func TestRelChecksOnlyTheRowsInTheDocument(t *testing.T) {
	t.Parallel()
	pool := newCatalog(t)
	// Product 10: variants 100 (position 2), 101 (1, no sku), 103 (3,
	// soft-deleted). Product 11: variant 102 (no sku).
	mustExec(t, pool, `UPDATE variants SET sku = NULL WHERE id IN (101, 102)`)
	s := catalogSpec(batch.ModeFull)
	s.Errors.Policy = batch.PolicyQuarantine
	sku := []batch.Field{{Name: "sku", Required: true}}
	s.Document.Relations = []batch.Relation{
		{Name: "top", Table: "variants", Type: batch.OneToMany, Deleted: "deleted_at", OrderBy: []string{"position desc"}, Limit: 1, Fields: sku},
		{Name: "first", Table: "variants", Type: batch.OneToOne, Deleted: "deleted_at", OrderBy: []string{"position desc"}, Fields: sku},
	}
	mustRun(t, pool, s, "full run")
	require.Equal(t, map[string]string{"11": "related_row: top [id=102] field sku (sku) is missing"}, openQuarantine(t, pool))
	d := relDocs(t, pool)
	require.Equal(t, []string{"10", "12"}, slices.Sorted(maps.Keys(d)))
	jsonEq(t, `{"id":10,"name":"Anvil","top":[{"sku":"A-S"}],"first":{"sku":"A-S"}}`, d["10"], "product 10: its bad variant 101 is not in the document")
}

// Rows that tie on order_by keep one order (the related table's primary
// key breaks the tie): rewriting a tied row without changing it leaves the
// document as it was, and emits nothing.
func TestRelOrderByTiesAreStable(t *testing.T) {
	t.Parallel()
	pool := newCatalog(t)
	mustExec(t, pool, `UPDATE variants SET position = 0 WHERE product_id = 10`)
	s := catalogSpec(batch.ModeFull)
	s.Document.Relations = []batch.Relation{{Name: "skus", Table: "variants", Type: batch.OneToMany, Variant: batch.VariantScalar,
		OrderBy: []string{"position"}, Fields: []batch.Field{{Name: "sku"}}}}
	mustRun(t, pool, s, "first run")
	jsonEq(t, `["A-S","A-L","A-X"]`, field(t, relDocs(t, pool)["10"], "skus"), "ties in id order")
	for _, id := range []int{101, 103} { // no prices refer to them
		// The same row again, elsewhere in the table and its indexes.
		mustExec(t, pool, `BEGIN; CREATE TEMP TABLE v ON COMMIT DROP AS SELECT * FROM variants WHERE id = `+fmt.Sprint(id)+`;
DELETE FROM variants WHERE id = `+fmt.Sprint(id)+`; INSERT INTO variants SELECT * FROM v; COMMIT`)
		mustRun(t, pool, s, fmt.Sprintf("run after rewriting %d", id))
		jsonEq(t, `["A-S","A-L","A-X"]`, field(t, relDocs(t, pool)["10"], "skus"), "ties in id order")
		v, _ := relEvents(t, pool, "10")
		require.Equal(t, []int64{1}, v, "nothing changed")
	}
}

// A join of columns of different but comparable types (accepted at
// start) resolves its captures: the captured keys are compared as their
// own column's values, never cast to the other column's type.
func TestRelCapturesOfAJoinAcrossTypes(t *testing.T) {
	t.Parallel()
	pool := newCatalog(t)
	mustExec(t, pool, `CREATE TABLE reviews (id int PRIMARY KEY, product_ref numeric(10,2), body text);
CREATE TABLE reactions (id bigint PRIMARY KEY, review_id bigint, emoji text);
INSERT INTO reviews VALUES (1, 10, 'good'), (2, 10.5, 'nobody''s');
INSERT INTO reactions VALUES (1, 1, 'heart'), (2, 5000000000, 'nobody''s')`)
	s := catalogSpec(batch.ModeIncremental)
	s.Document.Relations = []batch.Relation{{Name: "reviews", Table: "reviews", Type: batch.OneToMany,
		ForeignKey: &batch.KeyPair{Parent: "id", Child: "product_ref"}, Fields: []batch.Field{{Name: "body"}},
		Relations: []batch.Relation{{Name: "reactions", Table: "reactions", Type: batch.OneToMany, Variant: batch.VariantScalar,
			ForeignKey: &batch.KeyPair{Parent: "id", Child: "review_id"}, Fields: []batch.Field{{Name: "emoji"}}}}}}
	installCapture(t, pool, s)
	mustRun(t, pool, s, "first run")
	jsonEq(t, `[{"body":"good","reactions":["heart"]}]`, field(t, relDocs(t, pool)["10"], "reviews"), "reviews of 10")

	mustExec(t, pool, `INSERT INTO reviews VALUES (3, 10.00, 'fine'), (4, 11.25, 'nobody''s either');
UPDATE reactions SET emoji = 'star' WHERE id = 1; UPDATE reactions SET emoji = '?' WHERE id = 2`)
	mustRun(t, pool, s, "run after the changes")
	d := relDocs(t, pool)
	jsonEq(t, `[{"body":"good","reactions":["star"]},{"body":"fine","reactions":[]}]`, field(t, d["10"], "reviews"), "reviews of 10")
	jsonEq(t, `[]`, field(t, d["11"], "reviews"), "reviews of 11")
	require.Zero(t, queryInt(t, pool, `SELECT (SELECT count(*) FROM batch_relation_changes) + (SELECT count(*) FROM batch_relation_work)`))
}

// Related and join tables in another schema, with names and columns
// that need quoting (mixed case, a space), keys from the catalog: the
// documents and the capture triggers work with them.
func TestRelQuotedNamesInAnotherSchema(t *testing.T) {
	t.Parallel()
	pool := newCatalog(t)
	mustExec(t, pool, `CREATE SCHEMA "Shop";
CREATE TABLE "Shop"."Makers" ("MakerId" int PRIMARY KEY, "Name" text);
ALTER TABLE products ADD COLUMN "makerRef" int REFERENCES "Shop"."Makers";
CREATE TABLE "Shop"."Tags" ("TagId" int PRIMARY KEY, "Label" text);
CREATE TABLE "Shop"."Product Tags" ("ProductId" int REFERENCES products, "TagId" int REFERENCES "Shop"."Tags", PRIMARY KEY ("ProductId", "TagId"));
INSERT INTO "Shop"."Makers" VALUES (1, 'M1');
INSERT INTO "Shop"."Tags" VALUES (1, 'T1'), (2, 'T2');
INSERT INTO "Shop"."Product Tags" VALUES (10, 1);
UPDATE products SET "makerRef" = 1 WHERE id IN (10, 11)`)
	s := catalogSpec(batch.ModeIncremental)
	s.Document.Relations = []batch.Relation{
		{Name: "maker", Schema: "Shop", Table: "Makers", Type: batch.OneToOne, Fields: []batch.Field{{Name: "name", From: "Name"}}},
		{Name: "tags", Schema: "Shop", Table: "Tags", Type: batch.OneToMany, Variant: batch.VariantScalar, Through: &batch.Through{Table: "Product Tags"}, Fields: []batch.Field{{Name: "label", From: "Label"}}},
	}
	installCapture(t, pool, s)
	mustRun(t, pool, s, "first")
	d := relDocs(t, pool)
	jsonEq(t, `{"name":"M1"}`, field(t, d["10"], "maker"), "maker")
	jsonEq(t, `["T1"]`, field(t, d["10"], "tags"), "tags")
	mustExec(t, pool, `UPDATE "Shop"."Makers" SET "Name" = 'M2'; INSERT INTO "Shop"."Product Tags" VALUES (11, 2); UPDATE "Shop"."Tags" SET "Label" = 'T1!' WHERE "TagId" = 1`)
	mustRun(t, pool, s, "second")
	d = relDocs(t, pool)
	jsonEq(t, `{"name":"M2"}`, field(t, d["10"], "maker"), "maker 10")
	jsonEq(t, `{"name":"M2"}`, field(t, d["11"], "maker"), "maker 11")
	jsonEq(t, `["T1!"]`, field(t, d["10"], "tags"), "tags 10")
	jsonEq(t, `["T2"]`, field(t, d["11"], "tags"), "tags 11")
}
