package bench_peers

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// The relations leg (BENCH_PEERS_LEGS=relations): a product catalog whose
// documents come from five tables, PGSync's `children` beside outboxrelay's
// `document.relations` (issue #32), on the same rows and the same engine.
//
//	products (id, name, brand_id, version, change_seq, deleted_at)  the root
//	brands (id, name)                     one_to_one object "brand"
//	variants (id, product_id, sku, price, mark)   one_to_many objects "variants", 5 per product
//	categories (id, name) through product_categories (product_id, category_id)
//	                                      one_to_many scalars "categories", 2 per product
//
// Brand 1 is shared by the first relSharedBrand products (all of them when
// there are fewer); the others have about 200 products each.

// relSharedBrand is how many products share brand 1, the brand the rename
// leg renames.
const relSharedBrand = 10_000

// relVariants is the number of variants of every product.
const relVariants = 5

const (
	kindRelInitial = "relations: initial sync"
	kindRelChanges = "relations: variant updates"
	kindRelRename  = "relations: shared brand renamed"
)

// catalogSchemaSQL creates the catalog's tables (the keys and indexes
// come after the rows: catalogKeysSQL). products has the demo's version and
// change_seq trigger, which the incremental job needs.
const catalogSchemaSQL = `
CREATE SEQUENCE products_change_seq;
CREATE TABLE brands (id bigint PRIMARY KEY, name text NOT NULL);
CREATE TABLE categories (id bigint PRIMARY KEY, name text NOT NULL);
CREATE TABLE products (
    id          bigint      PRIMARY KEY,
    name        text        NOT NULL,
    brand_id    bigint      NOT NULL,
    version     bigint      NOT NULL DEFAULT 1,
    change_seq  bigint      NOT NULL DEFAULT nextval('products_change_seq'),
    deleted_at  timestamptz
);
CREATE TABLE variants (
    id          bigint      PRIMARY KEY,
    product_id  bigint      NOT NULL,
    sku         text        NOT NULL,
    price       numeric(10,2) NOT NULL,
    mark        bigint
);
CREATE TABLE product_categories (
    product_id  bigint NOT NULL,
    category_id bigint NOT NULL,
    PRIMARY KEY (product_id, category_id)
);
CREATE FUNCTION products_bump() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW IS DISTINCT FROM OLD THEN
        NEW.version := OLD.version + 1;
        NEW.change_seq := nextval('products_change_seq');
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER products_bump BEFORE UPDATE ON products FOR EACH ROW EXECUTE FUNCTION products_bump();`

// catalogRows are the statements that fill the tables for products
// products, shared of them with brand 1 and the rest spread over others
// more brands, each with its parameters.
func catalogRows(products, shared, others int64) []struct {
	sql  string
	args []any
} {
	v := fmt.Sprint(relVariants)
	return []struct {
		sql  string
		args []any
	}{
		{`INSERT INTO brands (id, name) SELECT b, 'Brand ' || b FROM generate_series(1, 1 + $1::bigint) AS b`, []any{others}},
		{`INSERT INTO categories (id, name) SELECT c, 'Category ' || c FROM generate_series(1, 50) AS c`, nil},
		{`INSERT INTO products (id, name, brand_id)
		  SELECT g, 'Product ' || g || ' ' || (ARRAY['shoe','shirt','lamp','chair','kettle'])[1 + g % 5],
		         CASE WHEN g <= $2::bigint THEN 1 ELSE 2 + g % $3::bigint END
		  FROM generate_series(1, $1::bigint) AS g`, []any{products, shared, others}},
		{`INSERT INTO variants (id, product_id, sku, price)
		  SELECT (g - 1) * ` + v + ` + j, g, 'SKU-' || g || '-' || j, 1 + ((g * 7 + j * 13) % 10000) / 100.0
		  FROM generate_series(1, $1::bigint) AS g, generate_series(1, ` + v + `) AS j`, []any{products}},
		// Two different categories per product (25 apart of 50).
		{`INSERT INTO product_categories (product_id, category_id)
		  SELECT g, 1 + (g + k * 25) % 50 FROM generate_series(1, $1::bigint) AS g, generate_series(0, 1) AS k`, []any{products}},
	}
}

// catalogKeysSQL adds the foreign keys (PGSync finds the through table's
// joins from them) and the indexes on the child keys, after the rows.
const catalogKeysSQL = `
ALTER TABLE products ADD FOREIGN KEY (brand_id) REFERENCES brands (id);
ALTER TABLE variants ADD FOREIGN KEY (product_id) REFERENCES products (id);
ALTER TABLE product_categories ADD FOREIGN KEY (product_id) REFERENCES products (id);
ALTER TABLE product_categories ADD FOREIGN KEY (category_id) REFERENCES categories (id);
CREATE UNIQUE INDEX products_change_seq_key ON products (change_seq);
CREATE INDEX products_brand_id ON products (brand_id);
CREATE INDEX variants_product_id ON variants (product_id);
CREATE INDEX product_categories_category_id ON product_categories (category_id);
ANALYZE;`

// relShared is how many products share brand 1.
func (s settings) relShared() int { return min(relSharedBrand, s.RelProducts) }

// seedCatalog creates the catalog in the database at url and fills it.
func (e *env) seedCatalog(b testing.TB, name, url string) *pgxpool.Pool {
	ctx := context.Background()
	pool := stack.Pool(b, url)
	t0 := time.Now()
	_, err := pool.Exec(ctx, catalogSchemaSQL)
	check(b, err)
	products, shared := int64(e.s.RelProducts), int64(e.s.relShared())
	others := max(1, (products-shared)/200)
	for _, q := range catalogRows(products, shared, others) {
		_, err := pool.Exec(ctx, q.sql, q.args...)
		check(b, err)
	}
	_, err = pool.Exec(ctx, catalogKeysSQL)
	check(b, err)
	b.Logf("%s: catalog of %d products, %d variants, %d brands seeded in %s", name, products, products*relVariants, others+1, time.Since(t0).Round(time.Millisecond))
	return pool
}

// variantOf is the variant the writer changes for product g: one per
// product, so each product document carries at most one mark (a search
// sorts on the lowest mark of the document's variants).
func variantOf(g int64) int64 { return (g-1)*relVariants + 1 + g%relVariants }

// variantUpdate is the relations writer's change: a variant's price and
// its mark, which its product's document carries (variants.mark).
const variantUpdate = `UPDATE variants SET price = price + 1, mark = $2 WHERE id = $1 RETURNING product_id`

// relWriter changes variants of the catalog's products in index.
func (e *env) relWriter(pool *pgxpool.Pool, index string) *writer {
	return &writer{pool: pool, maxGroup: e.s.RelProducts, search: e.search, index: index, markField: "variants.mark",
		update: variantUpdate, idOf: variantOf}
}

// pgsyncRelations runs PGSync's relations legs of one round.
func (e *env) pgsyncRelations(b testing.TB, round int) []leg {
	dbName := fmt.Sprintf("pgsync_rel_r%d", round)
	index := stack.UniqueName("bench-peers-pgsync-rel")
	defer e.dropDatabase(dbName)
	defer deleteIndex(e.search, index)
	url := e.createDatabase(b, dbName)
	pool := e.seedCatalog(b, dbName, url)
	defer pool.Close()

	rel := func(typ, variant string, fk map[string]any) map[string]any {
		r := map[string]any{"type": typ, "variant": variant}
		if fk != nil {
			r["foreign_key"] = fk
		}
		return r
	}
	schema := []map[string]any{{
		"database": dbName, "index": index,
		"nodes": map[string]any{
			"table": "products", "columns": []string{"id", "name", "brand_id"},
			"children": []map[string]any{
				{"table": "brands", "label": "brand", "columns": []string{"id", "name"},
					"relationship": rel("one_to_one", "object", map[string]any{"parent": []string{"brand_id"}, "child": []string{"id"}})},
				{"table": "variants", "label": "variants", "columns": []string{"id", "sku", "price", "mark"},
					"relationship": rel("one_to_many", "object", map[string]any{"parent": []string{"id"}, "child": []string{"product_id"}})},
				{"table": "categories", "label": "categories", "columns": []string{"name"},
					"relationship": func() map[string]any {
						r := rel("one_to_many", "scalar", nil)
						r["through_tables"] = []string{"product_categories"}
						return r
					}()},
			},
		},
	}}
	pgEnv, schemaFile := e.pgsyncConfig(b, dbName, url, schema)

	want := int64(e.s.RelProducts)
	before := e.serversCPU()
	took, cpu := e.pgsyncInitial(b, pgEnv, schemaFile, index, want)
	legs := []leg{e.withServers(leg{Tool: pgsyncName, Kind: kindRelInitial, Round: round, Docs: want, Seconds: took.Seconds(), ProcessCPU: cpu.Seconds()}, before)}
	b.Logf("pgsync relations round %d: %d products searchable in %s (process CPU %s)", round, want, took.Round(time.Millisecond), cpu.Round(time.Millisecond))

	d := testproc.Start(b, filepath.Join(e.s.PGSyncBin, "pgsync"), pgEnv, "--config", schemaFile, "--daemon")
	defer func() { _ = d.Signal(syscall.SIGTERM); _ = d.Wait(30 * time.Second) }()
	return append(legs, e.relationsLive(b, pool, index, pgsyncName, round, 0, nil, d)...)
}

// relationsSpecYAML is outboxrelay's job for the catalog: the products
// with the same fields and children as PGSync's schema, incremental (the
// follower's job), hard-deleted roots left alone (PGSync's leg deletes
// nothing either).
const relationsSpecYAML = `job: catalog
mode: incremental
source: {table: products, cursor: [change_seq], id: id, version: version, deleted: deleted_at}
document:
  fields:
    - {name: id, from: id}
    - {name: name, from: name}
    - {name: brand_id, from: brand_id}
  relations:
    - name: brand
      table: brands
      type: one_to_one
      foreign_key: {parent: brand_id, child: id}
      fields: [{name: id}, {name: name}]
    - name: variants
      table: variants
      type: one_to_many
      foreign_key: {parent: id, child: product_id}
      fields: [{name: id}, {name: sku}, {name: price}, {name: mark}]
    - name: categories
      table: categories
      type: one_to_many
      variant: scalar
      through: {table: product_categories, parent: product_id, child: category_id}
      foreign_key: {parent: id, child: id}
      fields: [{name: name}]
processor_version: v1
topic: %s
chunk: {size: 2000, min: 500, max: 20000, target_duration: 1s}
errors: {policy: quarantine}
`

// outboxrelayRelations runs outboxrelay's relations legs of one round: the
// relation triggers (follow-trigger --install), one `batcher run` of the
// incremental job as the initial sync, then `batcher run --follow`.
func (e *env) outboxrelayRelations(b testing.TB, round int) []leg {
	dbName := fmt.Sprintf("outboxrelay_rel_r%d", round)
	defer e.dropDatabase(dbName)
	url := e.createDatabase(b, dbName)
	e.migrate(b, url)
	pool := e.seedCatalog(b, dbName, url)
	defer pool.Close()

	pl := e.pipeline(b, url)
	defer pl.stop()
	specFile := filepath.Join(e.dir, dbName+"-job.yaml")
	check(b, os.WriteFile(specFile, []byte(fmt.Sprintf(relationsSpecYAML, pl.topic)), 0o644))
	e.followTrigger(b, pl, specFile)

	want := int64(e.s.RelProducts)
	before := e.serversCPU()
	took, cpu := e.batcherInitial(b, pl, specFile, want)
	legs := []leg{e.withServers(leg{Tool: ourName, Kind: kindRelInitial, Round: round, Docs: want, Seconds: took.Seconds(), ProcessCPU: cpu.Seconds()}, before)}
	b.Logf("outboxrelay relations round %d: %d products searchable in %s (processes CPU %s)", round, want, took.Round(time.Millisecond), cpu.Round(time.Millisecond))

	fp := testproc.Start(b, e.bins["batcher"], pl.env, "run", "--spec", specFile, "--follow")
	defer func() { _ = fp.Signal(syscall.SIGTERM); _ = fp.Wait(time.Minute) }()
	tw := watchTopic(b, e.brokers, pl.topic)
	defer tw.stop()
	return append(legs, e.relationsLive(b, pool, pl.alias, ourName, round, 50, tw.seen, fp, pl.pub, pl.idx)...)
}

// relationsLive measures a running follower (PGSync's daemon, outboxrelay's
// `batcher run --follow` and pipeline): brand 1, shared by relShared
// products, renamed, then variant UPDATEs at each BENCH_PEERS_REL_RATES.
// The rename comes first, while the follower is idle: after a rate it
// cannot keep up with, a tool's backlog would be counted in the rename's
// time (PGSync's at 500/s on 200,000 products was: 2,000 of its changes
// still not searchable a minute after the last commit). markBase keeps
// the two tools' marks apart.
func (e *env) relationsLive(b testing.TB, pool *pgxpool.Pool, index, tool string, round, markBase int, onTopic func(int64) (time.Time, bool), procs ...*testproc.Proc) []leg {
	w := e.relWriter(pool, index)
	w.onTopic = onTopic
	w.warmUp(b, procs...)
	logDocument(b, e.search, index, "1")
	l := renameBrand(b, pool, e.search, index, fmt.Sprintf("Brand 1 renamed r%d%s", round, stack.UniqueName("x")), int64(e.s.relShared()), procs...)
	l.Tool, l.Kind, l.Round = tool, kindRelRename, round
	b.Logf("%s: brand 1 renamed, its %d products searchable with the new name in %.2f s (the first after %.2f s)", index, l.Docs, l.Seconds, l.FirstSeconds)
	legs := []leg{l}
	for i, rate := range e.s.RelRates {
		waitMerges(b, e.search, index, 2*time.Minute)
		l := w.run(b, rate, e.s.LegDuration, int64(round*100+markBase+20+i)*100_000_000, nil, procs...)
		l.Tool, l.Kind, l.Round = tool, kindRelChanges, round
		legs = append(legs, l)
	}
	return legs
}

// renameBrand renames brand 1 to name and waits until want documents of
// index carry it (brand.name, searchable without a forced refresh): the
// time from the UPDATE's commit until the first and until all of them.
func renameBrand(b testing.TB, pool *pgxpool.Pool, search, index, name string, want int64, procs ...*testproc.Proc) leg {
	ctx := context.Background()
	tag, err := pool.Exec(ctx, `UPDATE brands SET name = $1 WHERE id = 1`, name)
	check(b, err)
	commit := time.Now()
	if tag.RowsAffected() != 1 {
		b.Fatalf("rename brand 1: %d rows updated", tag.RowsAffected())
	}
	body := map[string]any{"query": map[string]any{"match_phrase": map[string]any{"brand.name": name}}}
	l := leg{Docs: want}
	tick := time.NewTicker(pollEvery)
	defer tick.Stop()
	var last int64
	for range tick.C {
		for _, p := range procs {
			select {
			case <-p.Done():
				b.Fatalf("%s exited %d\n%s", filepath.Base(p.Cmd.Path), p.ExitCode(), lastLines(p.Stderr(), 30))
			default:
			}
		}
		var res struct {
			Count int64 `json:"count"`
		}
		if err := searchPost(ctx, search, "/"+url.PathEscape(index)+"/_count", body, &res); err != nil {
			continue
		}
		now := time.Since(commit).Seconds()
		last = res.Count
		if res.Count > 0 && l.FirstSeconds == 0 {
			l.FirstSeconds = now
		}
		if res.Count >= want {
			l.Seconds = now
			return l
		}
		if now > (10 * time.Minute).Seconds() {
			b.Fatalf("%s: %d of %d products searchable with brand 1's new name 10 minutes after its commit", index, last, want)
		}
	}
	panic("unreachable")
}

// logDocument logs the document id of index as a search returns it, so a
// run shows what each tool's documents look like.
func logDocument(b testing.TB, search, index, id string) {
	var res struct {
		Hits struct {
			Hits []struct {
				Source json.RawMessage `json:"_source"`
			} `json:"hits"`
		} `json:"hits"`
	}
	body := map[string]any{"size": 1, "query": map[string]any{"ids": map[string]any{"values": []string{id}}}}
	if err := searchPost(context.Background(), search, "/"+url.PathEscape(index)+"/_search", body, &res); err != nil || len(res.Hits.Hits) == 0 {
		b.Logf("%s: document %s not found (%v)", index, id, err)
		return
	}
	b.Logf("%s: document %s: %s", index, id, res.Hits.Hits[0].Source)
}
