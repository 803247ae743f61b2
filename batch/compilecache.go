package batch

import (
	"context"
	"fmt"
	"sync"
)

// compileCache keeps a follower's compiled spec across its runs. Compiling
// reads the catalog with some 25 statements (the tables' columns, keys,
// indexes, foreign keys, the change column's sequence), about a third of
// what a short follower run sends. Before each run one statement reads a
// fingerprint of that part of the catalog, and the spec is compiled again
// when it differs: a column added, dropped, renamed or retyped, a key or
// index changed, a sequence altered or a table replaced.
type compileCache struct {
	mu          sync.Mutex
	fingerprint string
	c           *compiled
}

// catalogFingerprintSQL hashes what compile reads of the tables $1
// (schema-qualified names as to_regclass takes them): each table's oid,
// its columns (name, type, collation, nullability, default, identity,
// generation), its constraints, its indexes, and the sequences its
// columns use. Types, collations and sequences by oid and by name too:
// the compiled statements name them (a cast, a regclass), so a rename
// compiles again. The fingerprint is read before compiling, so a change made
// while compiling makes the next look compile again.
const catalogFingerprintSQL = `
WITH t AS (SELECT n, to_regclass(n) AS oid FROM unnest($1::text[]) AS n)
SELECT md5(concat_ws('|',
  (SELECT string_agg(n || '=' || COALESCE(oid::oid::text, '-'), ',' ORDER BY n) FROM t),
  (SELECT string_agg(concat_ws(':', a.attrelid, a.attnum, a.attname, a.atttypid, a.atttypmod, format_type(a.atttypid, a.atttypmod),
      a.attcollation, a.attcollation::regcollation::text, a.attnotnull, a.attidentity, a.attgenerated,
      d.adbin::text), ',' ORDER BY a.attrelid, a.attnum)
     FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
     WHERE a.attrelid IN (SELECT oid FROM t) AND a.attnum > 0 AND NOT a.attisdropped),
  (SELECT string_agg(concat_ws(':', c.oid, c.contype, c.conrelid, c.confrelid, c.conkey::text, c.confkey::text, c.convalidated), ',' ORDER BY c.oid)
     FROM pg_constraint c WHERE c.conrelid IN (SELECT oid FROM t) OR c.confrelid IN (SELECT oid FROM t)),
  (SELECT string_agg(concat_ws(':', i.indexrelid, i.indkey::text, i.indclass::text, i.indcollation::text, i.indisunique, i.indisvalid, i.indisready,
      i.indexprs::text, i.indpred::text), ',' ORDER BY i.indexrelid)
     FROM pg_index i WHERE i.indrelid IN (SELECT oid FROM t)),
  (SELECT string_agg(concat_ws(':', s.seqrelid, s.seqrelid::regclass::text, s.seqtypid, s.seqincrement, s.seqcache, s.seqcycle), ',' ORDER BY s.seqrelid)
     FROM pg_sequence s WHERE s.seqrelid IN (
       SELECT d.objid FROM pg_depend d WHERE d.refclassid = 'pg_class'::regclass AND d.refobjid IN (SELECT oid FROM t) AND d.classid = 'pg_class'::regclass
       UNION SELECT d.refobjid FROM pg_depend d JOIN pg_attrdef ad ON d.classid = 'pg_attrdef'::regclass AND d.objid = ad.oid
         WHERE ad.adrelid IN (SELECT oid FROM t) AND d.refclassid = 'pg_class'::regclass))
))`

// get returns s compiled, compiling it only when the catalog's
// fingerprint of its tables changed since the last compile.
func (cc *compileCache) get(ctx context.Context, db querier, s Spec) (*compiled, error) {
	tables := append([]string{q(s.Source.Schema, s.Source.Table)}, quotedRelationTables(s)...)
	var fp string
	if err := db.QueryRow(ctx, catalogFingerprintSQL, tables).Scan(&fp); err != nil {
		return nil, fmt.Errorf("job %s: read the catalog of its tables: %w", s.Job, err)
	}
	cc.mu.Lock()
	if cc.c != nil && cc.fingerprint == fp {
		c := cc.c
		cc.mu.Unlock()
		return c, nil
	}
	cc.mu.Unlock()
	c, err := compile(ctx, db, s)
	if err != nil {
		return nil, err
	}
	cc.mu.Lock()
	cc.fingerprint, cc.c = fp, c
	cc.mu.Unlock()
	return c, nil
}

// quotedRelationTables names the spec's related tables as to_regclass
// takes them.
func quotedRelationTables(s Spec) []string {
	var out []string
	for _, t := range relationTables(s) {
		out = append(out, q(t[0], t[1]))
	}
	return out
}
