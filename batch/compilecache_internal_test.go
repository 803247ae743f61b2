package batch

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// The fingerprint a follower compares before reusing its compiled spec
// changes with every kind of schema change compile reads (and the renames
// of what the compiled statements name), and with nothing else: writes, VACUUM and ANALYZE leave it as it was.
func TestCatalogFingerprintChangesWithTheSchemaOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := stack.Pool(t, stack.Database(t))
	_, err := pool.Exec(ctx, `
CREATE SEQUENCE items_seq;
CREATE TABLE owners (id int PRIMARY KEY, name text);
CREATE TABLE items (id int PRIMARY KEY, owner_id int, title text, change_seq bigint NOT NULL DEFAULT nextval('items_seq'));
CREATE TABLE parts (id int PRIMARY KEY, item_id int NOT NULL, label text);
INSERT INTO owners VALUES (1, 'o');
INSERT INTO items (id, owner_id, title) VALUES (1, 1, 'a')`)
	require.NoError(t, err)
	tables := []string{`"public"."items"`, `"public"."parts"`, `"public"."owners"`}
	fingerprint := func() string {
		t.Helper()
		var fp string
		require.NoError(t, pool.QueryRow(ctx, catalogFingerprintSQL, tables).Scan(&fp))
		return fp
	}
	last := fingerprint()
	for _, x := range []struct {
		sql     string
		changes bool
	}{
		{`INSERT INTO items (id, owner_id, title) VALUES (2, 1, 'b'); UPDATE items SET title = 'c' WHERE id = 1; DELETE FROM items WHERE id = 2`, false},
		{`VACUUM ANALYZE items`, false},
		{`SELECT nextval('items_seq')`, false},
		{`ALTER TABLE items ADD COLUMN body text`, true},
		{`ALTER TABLE items RENAME COLUMN body TO text_body`, true},
		{`ALTER TABLE items ALTER COLUMN text_body TYPE varchar(20)`, true},
		{`UPDATE items SET text_body = 'x'; ALTER TABLE items ALTER COLUMN text_body SET NOT NULL`, true},
		{`ALTER TABLE items DROP COLUMN text_body`, true},
		{`ALTER TABLE items ALTER COLUMN title SET DEFAULT 'x'`, true},
		{`ALTER TABLE items ALTER COLUMN title TYPE text COLLATE "C"`, true},
		{`CREATE INDEX items_owner ON items (owner_id)`, true},
		{`DROP INDEX items_owner`, true},
		{`CREATE INDEX parts_item ON parts (item_id)`, true},
		{`ALTER TABLE items ADD CONSTRAINT items_owner_fk FOREIGN KEY (owner_id) REFERENCES owners`, true},
		{`ALTER TABLE parts ADD CONSTRAINT parts_item_fk FOREIGN KEY (item_id) REFERENCES items`, true},
		{`ALTER SEQUENCE items_seq CACHE 10`, true},
		{`ALTER SEQUENCE items_seq RENAME TO items_seq2`, true},
		{`CREATE DOMAIN label AS text; ALTER TABLE parts ALTER COLUMN label TYPE label`, true},
		{`ALTER DOMAIN label RENAME TO tag`, true},
		{`ALTER TABLE items ALTER COLUMN change_seq SET DEFAULT nextval('items_seq2'::regclass) + 0`, true},
		{`ALTER TABLE owners RENAME TO owners_old; CREATE TABLE owners (id int PRIMARY KEY, name text)`, true},
	} {
		_, err := pool.Exec(ctx, x.sql)
		require.NoError(t, err, x.sql)
		fp := fingerprint()
		if x.changes {
			require.NotEqual(t, last, fp, "the fingerprint did not change after %s", x.sql)
		} else {
			require.Equal(t, last, fp, "the fingerprint changed after %s", x.sql)
		}
		last = fp
	}
}

// A related table in a schema whose name holds a dot is named whole: the
// fingerprint finds its columns, and its captures wake the follower.
func TestRelationTablesKeepADottedSchema(t *testing.T) {
	s := Spec{Job: "j", Source: Source{Table: "products"}, Document: Document{Relations: []Relation{
		{Name: "maker", Schema: "my.shop", Table: "makers", Type: OneToOne},
		{Name: "tags", Table: "tags", Type: OneToMany, Through: &Through{Schema: "my.shop", Table: "product tags"}},
	}}}
	require.Equal(t, []string{`"my.shop"."makers"`, `"public"."tags"`, `"my.shop"."product tags"`}, quotedRelationTables(s))
}
