package batch_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// catalogSQL is a small product catalog: every relation kind, two levels.
const catalogSQL = `
CREATE SEQUENCE products_change_seq CACHE 1;
CREATE TABLE brands (id int PRIMARY KEY, name text NOT NULL);
CREATE TABLE products (
  id int PRIMARY KEY, name text NOT NULL, brand_id int REFERENCES brands,
  version bigint NOT NULL DEFAULT 1, change_seq bigint NOT NULL DEFAULT nextval('products_change_seq'), deleted_at timestamptz);
CREATE UNIQUE INDEX ON products (change_seq, id);
CREATE FUNCTION products_touch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN NEW.version := OLD.version + 1; NEW.change_seq := nextval('products_change_seq'); RETURN NEW; END $$;
CREATE TRIGGER products_touch BEFORE UPDATE ON products FOR EACH ROW EXECUTE FUNCTION products_touch();
CREATE TABLE variants (id int PRIMARY KEY, product_id int NOT NULL REFERENCES products, sku text, position int NOT NULL DEFAULT 0, deleted_at timestamptz);
CREATE INDEX ON variants (product_id);
CREATE TABLE prices (id int PRIMARY KEY, variant_id int NOT NULL REFERENCES variants, currency text NOT NULL, amount numeric NOT NULL);
CREATE INDEX ON prices (variant_id);
CREATE TABLE categories (id int PRIMARY KEY, name text NOT NULL);
CREATE TABLE product_categories (product_id int NOT NULL REFERENCES products, category_id int NOT NULL REFERENCES categories, PRIMARY KEY (product_id, category_id));
CREATE INDEX ON product_categories (category_id);

INSERT INTO brands VALUES (1, 'Acme'), (2, 'Bolt');
INSERT INTO products (id, name, brand_id) VALUES (10, 'Anvil', 1), (11, 'Rocket', 1), (12, 'Nut', NULL);
INSERT INTO variants VALUES (100, 10, 'A-S', 2, NULL), (101, 10, 'A-L', 1, NULL), (102, 11, 'R-1', 0, NULL), (103, 10, 'A-X', 3, now());
INSERT INTO prices VALUES (1000, 100, 'EUR', 9.5), (1001, 100, 'USD', 10), (1002, 102, 'EUR', 99);
INSERT INTO categories VALUES (1, 'Tools'), (2, 'Sale');
INSERT INTO product_categories VALUES (10, 2), (10, 1), (11, 1);
`

func catalogSpec(mode string) batch.Spec {
	s := batch.Spec{
		Job: "products", Mode: mode, ProcessorVersion: "v1",
		Source:   batch.Source{Table: "products", ID: "id", Version: "version", Deleted: "deleted_at"},
		Document: batch.Document{Fields: []batch.Field{{Name: "id"}, {Name: "name"}}},
		Chunk:    batch.ChunkSettings{Size: 2, Min: 2, Max: 2},
		Errors:   batch.ErrorPolicy{PartitionAttempts: 1},
	}
	if mode == batch.ModeIncremental {
		s.Source.Cursor = []string{"change_seq", "id"}
	}
	s.Document.Relations = []batch.Relation{
		{Name: "brand", Table: "brands", Type: batch.OneToOne, Fields: []batch.Field{{Name: "name", Transforms: []string{"upper"}}}},
		{Name: "variants", Table: "variants", Type: batch.OneToMany, Deleted: "deleted_at", OrderBy: []string{"position", "id"},
			Fields: []batch.Field{{Name: "sku"}},
			Relations: []batch.Relation{{Name: "prices", Table: "prices", Type: batch.OneToMany, OrderBy: []string{"currency"},
				Fields: []batch.Field{{Name: "currency"}, {Name: "amount"}}}}},
		{Name: "categories", Table: "categories", Type: batch.OneToMany, Variant: batch.VariantScalar,
			Through: &batch.Through{Table: "product_categories"}, OrderBy: []string{"name"}, Fields: []batch.Field{{Name: "name"}}},
	}
	return s
}

func newCatalog(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool := stack.Pool(t, stack.Database(t))
	_, err := pool.Exec(context.Background(), catalogSQL)
	require.NoError(t, err)
	return pool
}

// relDocs reads the live documents of source "products" over a new
// connection, by id.
func relDocs(t *testing.T, pool *pgxpool.Pool) map[string]string {
	t.Helper()
	return relDocsOf(t, pool, "products")
}

func jsonEq(t *testing.T, want, got string, msg string) {
	t.Helper()
	var w, g any
	require.NoError(t, json.Unmarshal([]byte(want), &w))
	require.NoError(t, json.Unmarshal([]byte(got), &g), got)
	require.Equal(t, w, g, msg)
}

func TestRelationsFullRunBuildsNestedDocuments(t *testing.T) {
	pool := newCatalog(t)
	sum, err := run(t, pool, catalogSpec(batch.ModeFull), batch.Config{})
	require.NoError(t, err)
	require.True(t, sum.Done)
	d := relDocs(t, pool)
	require.Len(t, d, 3)
	jsonEq(t, `{"id":10,"name":"Anvil","brand":{"name":"ACME"},
	  "variants":[{"sku":"A-L","prices":[]},{"sku":"A-S","prices":[{"currency":"EUR","amount":9.5},{"currency":"USD","amount":10}]}],
	  "categories":["Sale","Tools"]}`, d["10"], "product 10")
	jsonEq(t, `{"id":11,"name":"Rocket","brand":{"name":"ACME"},"variants":[{"sku":"R-1","prices":[{"currency":"EUR","amount":99}]}],"categories":["Tools"]}`, d["11"], "product 11")
	jsonEq(t, `{"id":12,"name":"Nut","brand":null,"variants":[],"categories":[]}`, d["12"], "product 12")
}

// relEvents reads, over a new connection, the events of root id: their
// versions and types in insertion order.
func relEvents(t *testing.T, pool *pgxpool.Pool, id string) (versions []int64, types []string) {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT aggregate_version, event_type FROM outbox_event_members WHERE aggregate_id = $1 ORDER BY id`, id)
	require.NoError(t, err)
	for rows.Next() {
		var v int64
		var typ string
		require.NoError(t, rows.Scan(&v, &typ))
		versions, types = append(versions, v), append(types, typ)
	}
	require.NoError(t, rows.Err())
	return versions, types
}

func TestRelationsIncrementalRefusedWithoutCapture(t *testing.T) {
	pool := newCatalog(t)
	_, err := run(t, pool, catalogSpec(batch.ModeIncremental), batch.Config{})
	require.ErrorIs(t, err, batch.ErrSpec)
	require.ErrorContains(t, err, "follow-trigger --install")
	require.ErrorContains(t, err, "public.brands")
}

func TestRelationsChangesAnywhereReachTheirRoots(t *testing.T) {
	pool := newCatalog(t)
	ctx := context.Background()
	s := catalogSpec(batch.ModeIncremental)
	s.Vanished = batch.VanishedDelete
	sql, err := batch.FollowTriggerSQLFor(ctx, pool, s)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, sql)
	require.NoError(t, err)
	m := batch.NewMetrics(nil, pool)
	step := func(name, change string) map[string]string {
		t.Helper()
		if change != "" {
			_, err := pool.Exec(ctx, change)
			require.NoError(t, err, name)
		}
		sum, err := run(t, pool, s, batch.Config{Metrics: m})
		require.NoError(t, err, name)
		require.True(t, sum.Done, name)
		return relDocs(t, pool)
	}
	d := step("first run", "")
	require.Len(t, d, 3)
	v10, _ := relEvents(t, pool, "10")
	require.Equal(t, []int64{1}, v10)

	d = step("parent renamed", `UPDATE brands SET name = 'Acme Corp' WHERE id = 1`)
	jsonEq(t, `{"name":"ACME CORP"}`, field(t, d["10"], "brand"), "brand of 10")
	jsonEq(t, `{"name":"ACME CORP"}`, field(t, d["11"], "brand"), "brand of 11")
	v10, _ = relEvents(t, pool, "10")
	require.Equal(t, []int64{1, 2}, v10, "one event at version 2: the product row's version did not change")
	v12, _ := relEvents(t, pool, "12")
	require.Equal(t, []int64{1}, v12, "product 12 has no brand")
	require.Equal(t, 2.0, testutil.ToFloat64(m.RelationRoots.WithLabelValues(s.Job, "queued")), "batch_relation_roots_total{status=queued}")
	require.Equal(t, 2.0, testutil.ToFloat64(m.RelationRoots.WithLabelValues(s.Job, "changed")), "batch_relation_roots_total{status=changed}")

	d = step("child moved to another root", `UPDATE variants SET product_id = 11 WHERE id = 101`)
	jsonEq(t, `[{"sku":"A-S","prices":[{"currency":"EUR","amount":9.5},{"currency":"USD","amount":10}]}]`, field(t, d["10"], "variants"), "variants of 10")
	jsonEq(t, `[{"sku":"R-1","prices":[{"currency":"EUR","amount":99}]},{"sku":"A-L","prices":[]}]`, field(t, d["11"], "variants"), "variants of 11")

	d = step("grandchild changed", `UPDATE prices SET amount = 8 WHERE id = 1000`)
	jsonEq(t, `[{"sku":"A-S","prices":[{"currency":"EUR","amount":8},{"currency":"USD","amount":10}]}]`, field(t, d["10"], "variants"), "variants of 10")

	before, _ := relEvents(t, pool, "10")
	d = step("a change that leaves the document as it was", `UPDATE variants SET sku = sku WHERE id = 100; UPDATE variants SET position = 9 WHERE id = 102`)
	after, _ := relEvents(t, pool, "10")
	require.Equal(t, before, after, "an unchanged document emits no event")

	d = step("join row removed, category renamed", `DELETE FROM product_categories WHERE product_id = 10 AND category_id = 2; UPDATE categories SET name = 'Hardware' WHERE id = 1`)
	jsonEq(t, `["Hardware"]`, field(t, d["10"], "categories"), "categories of 10")
	jsonEq(t, `["Hardware"]`, field(t, d["11"], "categories"), "categories of 11")

	d = step("child soft-deleted and one hard-deleted", `UPDATE variants SET deleted_at = now() WHERE id = 101; DELETE FROM prices WHERE variant_id = 100; DELETE FROM variants WHERE id = 100`)
	jsonEq(t, `[]`, field(t, d["10"], "variants"), "variants of 10")
	jsonEq(t, `[{"sku":"R-1","prices":[{"currency":"EUR","amount":99}]}]`, field(t, d["11"], "variants"), "variants of 11")

	d = step("root deleted while its children change", `UPDATE variants SET sku = 'R-2' WHERE id = 102; DELETE FROM prices WHERE variant_id = 102; DELETE FROM variants WHERE product_id = 11; DELETE FROM product_categories WHERE product_id = 11; DELETE FROM products WHERE id = 11`)
	require.NotContains(t, d, "11")
	v11, types11 := relEvents(t, pool, "11")
	require.Equal(t, "delete", types11[len(types11)-1], "the last event of a deleted root is its delete: %v %v", v11, types11)
	for i := 1; i < len(v11); i++ {
		require.Greater(t, v11[i], v11[i-1], "versions of 11 only grow: %v", v11)
	}
	var left int
	require.NoError(t, pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM batch_relation_changes) + (SELECT count(*) FROM batch_relation_work)`).Scan(&left))
	require.Zero(t, left, "captures and work are consumed")
}

// field returns the JSON of key k of document doc.
func field(t *testing.T, doc, k string) string {
	t.Helper()
	var m map[string]json.RawMessage
	require.NoError(t, json.Unmarshal([]byte(doc), &m), doc)
	v, ok := m[k]
	require.True(t, ok, "%s has no %s", doc, k)
	return string(v)
}

func TestRelationsTruncatedChildRebuildsEveryRoot(t *testing.T) {
	pool := newCatalog(t)
	ctx := context.Background()
	s := catalogSpec(batch.ModeIncremental)
	sql, err := batch.FollowTriggerSQLFor(ctx, pool, s)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, sql)
	require.NoError(t, err)
	_, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `TRUNCATE prices`)
	require.NoError(t, err)
	sum, err := run(t, pool, s, batch.Config{})
	require.NoError(t, err)
	require.True(t, sum.Done)
	d := relDocs(t, pool)
	jsonEq(t, `[{"sku":"A-L","prices":[]},{"sku":"A-S","prices":[]}]`, field(t, d["10"], "variants"), "variants of 10")
	jsonEq(t, `[{"sku":"R-1","prices":[]}]`, field(t, d["11"], "variants"), "variants of 11")
	v12, _ := relEvents(t, pool, "12")
	require.Equal(t, []int64{1}, v12, "product 12 was rebuilt, unchanged: no event")
}

func TestRelationsCaptureTriggersMatchTheRelations(t *testing.T) {
	pool := newCatalog(t)
	ctx := context.Background()
	s := catalogSpec(batch.ModeIncremental)
	sql, err := batch.FollowTriggerSQLFor(ctx, pool, s)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, sql)
	require.NoError(t, err)
	_, err = run(t, pool, s, batch.Config{})
	require.NoError(t, err)

	// Another transform and processor version: the same captures.
	v2 := catalogSpec(batch.ModeIncremental)
	v2.ProcessorVersion = "v2"
	v2.Document.Relations[0].Fields[0].Transforms = []string{"lower"}
	_, err = run(t, pool, v2, batch.Config{})
	require.NoError(t, err)

	// A relation joined on another column: the installed capture records
	// the old one, and the run says so.
	v3 := catalogSpec(batch.ModeIncremental)
	v3.ProcessorVersion = "v3"
	v3.Document.Relations[1].Relations[0].Name = "price_list"
	_, err = run(t, pool, v3, batch.Config{})
	require.ErrorIs(t, err, batch.ErrSpec)
	require.ErrorContains(t, err, "public.prices")
	require.ErrorContains(t, err, "installed for other relations")
}

func TestRelationSpecErrorsNameTheSetting(t *testing.T) {
	base := `job: j
source: {table: products, version: version}
processor_version: v1
document:
  fields: [{name: id}]
  relations:
`
	for _, tc := range []struct{ rel, want string }{
		{`    - {name: v, table: variants, type: many, fields: [{name: sku}]}`, `document.relations[v].type "many": want one_to_one`},
		{`    - {name: v, table: variants, type: one_to_many, variant: flatten, fields: [{name: sku}]}`, `variant flatten needs type one_to_one`},
		{`    - {name: v, table: variants, type: one_to_many, variant: scalar, fields: [{name: sku}, {name: id}]}`, `variant scalar needs exactly one field, has 2`},
		{`    - {name: v, table: variants, type: one_to_many, fields: []}`, `document.relations[v].fields: at least one field is required`},
		{`    - {name: id, table: variants, type: one_to_many, fields: [{name: sku}]}`, `the key "id" appears twice`},
		{`    - {name: v, table: variants, type: one_to_one, limit: 3, fields: [{name: sku}]}`, `only a one_to_many relation has a limit`},
		{`    - {name: v, table: variants, type: one_to_many, order_by: ["id sideways"], fields: [{name: sku}]}`, `order_by "id sideways"`},
		{`    - {name: v, table: variants, type: one_to_many, foreign_key: {parent: id}, fields: [{name: sku}]}`, `foreign_key needs both parent and child`},
		{`    - {name: v, table: variants, type: one_to_many, fields: [{name: sku, transforms: [shout]}]}`, `document.relations[v].fields[0] (sku): transform "shout"`},
		{`    - {name: v, table: variants, type: one_to_many, fields: [{name: sku}], relations: [{name: p, table: prices, type: one_to_many, fields: [{name: a}], relations: [{name: q, table: q, type: one_to_one, fields: [{name: a}], relations: [{name: r, table: r, type: one_to_one, fields: [{name: a}], relations: [{name: s, table: s, type: one_to_one, fields: [{name: a}]}]}]}]}]}`, `relations nest 5 deep; at most 4`},
		{`    - {name: b, table: brands, type: one_to_one, variant: flatten, fields: [{name: id}]}`, `flattened key "id" is already in the parent object`},
	} {
		_, err := batch.ParseSpec([]byte(base+tc.rel), ".yaml")
		require.ErrorContains(t, err, tc.want, tc.rel)
	}
}

func TestRelationsNameTheJoinColumnsWithoutIndex(t *testing.T) {
	pool := newCatalog(t)
	ctx := context.Background()
	missing, err := batch.UnindexedJoins(ctx, pool, catalogSpec(batch.ModeFull))
	require.NoError(t, err)
	require.Equal(t, []string{"public.products.brand_id (read to find the documents of a changed public.brands row): CREATE INDEX ON \"public\".\"products\" (\"brand_id\")"}, missing)
	_, err = pool.Exec(ctx, `CREATE INDEX ON products (brand_id)`)
	require.NoError(t, err)
	missing, err = batch.UnindexedJoins(ctx, pool, catalogSpec(batch.ModeFull))
	require.NoError(t, err)
	require.Empty(t, missing)
}

func installCapture(t *testing.T, pool *pgxpool.Pool, s batch.Spec) {
	t.Helper()
	ctx := context.Background()
	sql, err := batch.FollowTriggerSQLFor(ctx, pool, s)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, sql)
	require.NoError(t, err)
}

func TestRelationsReviewFixes(t *testing.T) {
	ctx := context.Background()
	t.Run("a relation job is the only writer of its source name", func(t *testing.T) {
		pool := newCatalog(t)
		_, err := run(t, pool, catalogSpec(batch.ModeFull), batch.Config{})
		require.NoError(t, err)
		other := catalogSpec(batch.ModeFull)
		other.Job = "products-nightly"
		_, err = run(t, pool, other, batch.Config{})
		require.ErrorIs(t, err, batch.ErrSpec)
		require.ErrorContains(t, err, `source_name "products" is also written by job products`)
	})
	t.Run("the relation phase stays in the listed partitions", func(t *testing.T) {
		pool := newCatalog(t)
		_, err := pool.Exec(ctx, `ALTER TABLE products ADD shard int NOT NULL DEFAULT 1; UPDATE products SET shard = 2 WHERE id = 11`)
		require.NoError(t, err)
		s := catalogSpec(batch.ModeIncremental)
		s.Source.Partition, s.Source.Partitions = "shard", []string{"1"}
		installCapture(t, pool, s)
		_, err = run(t, pool, s, batch.Config{})
		require.NoError(t, err)
		require.NotContains(t, relDocs(t, pool), "11")
		_, err = pool.Exec(ctx, `UPDATE variants SET sku = 'R-9' WHERE product_id = 11; UPDATE brands SET name = 'Acme 2' WHERE id = 1; TRUNCATE prices`)
		require.NoError(t, err)
		_, err = run(t, pool, s, batch.Config{})
		require.NoError(t, err)
		d := relDocs(t, pool)
		require.NotContains(t, d, "11", "product 11 is in shard 2, outside the job")
		jsonEq(t, `{"name":"ACME 2"}`, field(t, d["10"], "brand"), "brand of 10")
		v11, _ := relEvents(t, pool, "11")
		require.Empty(t, v11)
	})
	t.Run("only the rows the document holds can make it bad", func(t *testing.T) {
		pool := newCatalog(t)
		s := catalogSpec(batch.ModeFull)
		s.Errors.Policy = batch.PolicyQuarantine
		s.Document.Relations[1].Limit = 1
		s.Document.Relations[1].Fields[0].Required = true
		_, err := pool.Exec(ctx, `INSERT INTO variants VALUES (104, 10, NULL, 7, NULL)`)
		require.NoError(t, err)
		_, err = run(t, pool, s, batch.Config{})
		require.NoError(t, err)
		var bad int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM batch_quarantine`).Scan(&bad))
		require.Zero(t, bad, "variant 104 is past the limit: not in the document")
		_, err = pool.Exec(ctx, `UPDATE variants SET position = -1 WHERE id = 104`)
		require.NoError(t, err)
		_, err = run(t, pool, s, batch.Config{})
		require.NoError(t, err)
		var msg string
		require.NoError(t, pool.QueryRow(ctx, `SELECT source_id || ': ' || message FROM batch_quarantine`).Scan(&msg))
		require.Equal(t, "10: variants [id=104] field sku (sku) is missing", msg)
	})
	t.Run("another processor version is written one version up", func(t *testing.T) {
		pool := newCatalog(t)
		_, err := run(t, pool, catalogSpec(batch.ModeFull), batch.Config{})
		require.NoError(t, err)
		v2 := catalogSpec(batch.ModeFull)
		v2.ProcessorVersion = "v2" // the same documents: only the version says v2
		_, err = run(t, pool, v2, batch.Config{})
		require.NoError(t, err)
		v10, _ := relEvents(t, pool, "10")
		require.Equal(t, []int64{1, 2}, v10, "the v2 document of product 10 (row version 1)")
	})
}

func TestRelationsSecondReviewFixes(t *testing.T) {
	ctx := context.Background()
	t.Run("writes naming a partition of a related table are captured", func(t *testing.T) {
		pool := stack.Pool(t, stack.Database(t))
		_, err := pool.Exec(ctx, `
CREATE TABLE posts (id int PRIMARY KEY, version bigint NOT NULL DEFAULT 1, change_seq bigserial NOT NULL UNIQUE);
CREATE TABLE notes (id int NOT NULL, post_id int NOT NULL, body text, PRIMARY KEY (id)) PARTITION BY RANGE (id);
CREATE TABLE notes_a PARTITION OF notes FOR VALUES FROM (0) TO (100);
CREATE TABLE notes_b PARTITION OF notes FOR VALUES FROM (100) TO (200) PARTITION BY RANGE (id);
CREATE TABLE notes_b1 PARTITION OF notes_b FOR VALUES FROM (100) TO (200);
CREATE INDEX ON notes (post_id);
INSERT INTO posts (id) VALUES (1), (2);
INSERT INTO notes VALUES (1, 1, 'a'), (150, 2, 'b');`)
		require.NoError(t, err)
		s := batch.Spec{Job: "posts", Mode: batch.ModeIncremental, ProcessorVersion: "v1",
			Source: batch.Source{Table: "posts", Cursor: []string{"change_seq"}, Version: "version"},
			Document: batch.Document{Fields: []batch.Field{{Name: "id"}}, Relations: []batch.Relation{{Name: "notes", Table: "notes", Type: batch.OneToMany,
				ForeignKey: &batch.KeyPair{Parent: "id", Child: "post_id"}, Fields: []batch.Field{{Name: "body"}}}}},
			Errors: batch.ErrorPolicy{PartitionAttempts: 1}}
		installCapture(t, pool, s)
		_, err = run(t, pool, s, batch.Config{})
		require.NoError(t, err)
		// notes_b is partitioned itself: a statement naming it fires its
		// own statement triggers only, as one naming the leaf does.
		_, err = pool.Exec(ctx, `UPDATE notes_b SET body = 'b2' WHERE id = 150; INSERT INTO notes_a VALUES (2, 1, 'a2')`)
		require.NoError(t, err)
		_, err = run(t, pool, s, batch.Config{})
		require.NoError(t, err)
		d := relDocsOf(t, pool, "posts")
		jsonEq(t, `[{"body":"a"},{"body":"a2"}]`, field(t, d["1"], "notes"), "notes of 1")
		jsonEq(t, `[{"body":"b2"}]`, field(t, d["2"], "notes"), "notes of 2")
		_, err = pool.Exec(ctx, `INSERT INTO notes_b1 VALUES (160, 2, 'b3')`)
		require.NoError(t, err)
		_, err = run(t, pool, s, batch.Config{})
		require.NoError(t, err)
		jsonEq(t, `[{"body":"b2"},{"body":"b3"}]`, field(t, relDocsOf(t, pool, "posts")["2"], "notes"), "notes of 2, a leaf named")

		// A partition added later has no capture: the run says so.
		_, err = pool.Exec(ctx, `CREATE TABLE notes_c PARTITION OF notes FOR VALUES FROM (200) TO (300)`)
		require.NoError(t, err)
		_, err = run(t, pool, s, batch.Config{})
		require.ErrorIs(t, err, batch.ErrSpec)
		require.ErrorContains(t, err, "notes_c")
	})
	t.Run("keys are captured whatever the writer's date style", func(t *testing.T) {
		pool := stack.Pool(t, stack.Database(t))
		_, err := pool.Exec(ctx, `
CREATE TABLE days (day date PRIMARY KEY, label text NOT NULL);
CREATE TABLE shows (id int PRIMARY KEY, day date NOT NULL REFERENCES days, version bigint NOT NULL DEFAULT 1, change_seq bigserial NOT NULL UNIQUE);
CREATE INDEX ON shows (day);
INSERT INTO days VALUES ('2026-12-03', 'Thursday'), ('2026-12-25', 'Christmas');
INSERT INTO shows (id, day) VALUES (1, '2026-12-03'), (2, '2026-12-25');`)
		require.NoError(t, err)
		s := batch.Spec{Job: "shows", Mode: batch.ModeIncremental, ProcessorVersion: "v1",
			Source:   batch.Source{Table: "shows", Cursor: []string{"change_seq"}, Version: "version"},
			Document: batch.Document{Fields: []batch.Field{{Name: "id"}}, Relations: []batch.Relation{{Name: "day", Table: "days", Type: batch.OneToOne, Fields: []batch.Field{{Name: "label"}}}}},
			Errors:   batch.ErrorPolicy{PartitionAttempts: 1}}
		installCapture(t, pool, s)
		_, err = run(t, pool, s, batch.Config{})
		require.NoError(t, err)
		conn, err := pool.Acquire(ctx)
		require.NoError(t, err)
		_, err = conn.Exec(ctx, `SET datestyle = 'SQL, DMY'; UPDATE days SET label = label || '!'; RESET datestyle`)
		conn.Release()
		require.NoError(t, err)
		_, err = run(t, pool, s, batch.Config{})
		require.NoError(t, err)
		d := relDocsOf(t, pool, "shows")
		jsonEq(t, `{"label":"Thursday!"}`, field(t, d["1"], "day"), "show 1")
		jsonEq(t, `{"label":"Christmas!"}`, field(t, d["2"], "day"), "show 2")
	})
	t.Run("a named run beside an unfinished one is refused", func(t *testing.T) {
		pool := newCatalog(t)
		s := catalogSpec(batch.ModeIncremental)
		installCapture(t, pool, s)
		ctx, cancel := context.WithCancel(ctx)
		r, err := batch.NewRunner(pool, s, batch.Config{StartOptions: batch.StartOptions{RunID: "first"}})
		require.NoError(t, err)
		_, err = r.Prepare(ctx)
		require.NoError(t, err)
		cancel()
		_, err = run(t, pool, s, batch.Config{StartOptions: batch.StartOptions{RunID: "second"}})
		require.ErrorIs(t, err, batch.ErrCheckpointIncompatible)
		require.ErrorContains(t, err, "run first of job products is not finished")
	})
	t.Run("a capture trigger enabled for replicas only is refused", func(t *testing.T) {
		pool := newCatalog(t)
		s := catalogSpec(batch.ModeIncremental)
		installCapture(t, pool, s)
		var name string
		require.NoError(t, pool.QueryRow(ctx, `SELECT tgname FROM pg_trigger WHERE tgrelid = 'prices'::regclass AND tgname LIKE 'outboxrelay_rel_%_upd'`).Scan(&name))
		_, err := pool.Exec(ctx, `ALTER TABLE prices ENABLE REPLICA TRIGGER `+name)
		require.NoError(t, err)
		_, err = run(t, pool, s, batch.Config{})
		require.ErrorIs(t, err, batch.ErrSpec)
		require.ErrorContains(t, err, name)
	})
}

func TestRelationsRefuseACustomProcessor(t *testing.T) {
	proc := batch.ProcessorFunc(func(context.Context, []batch.SourceRow) ([]batch.Result, error) { return nil, nil })
	_, err := batch.NewRunner(nil, catalogSpec(batch.ModeFull), batch.Config{Processor: proc, LeaseTTL: time.Hour})
	require.ErrorIs(t, err, batch.ErrSpec)
	require.ErrorContains(t, err, "a custom Processor cannot build documents with document.relations")
}
