package batch

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Deletes in incremental runs (Spec.Vanished = delete on an incremental
// job; a full job with vanished: delete drains the captures too when its
// table has the trigger, the exits being its sweep's). A hard DELETE or a TRUNCATE leaves no change value behind, and a
// row that leaves the scope is no longer read by the chunks, so none of
// them reaches the index through the scan. Three things make them:
//
//   - The capture: the triggers [FollowTriggerSQL] installs write, in the
//     writer's own transaction, one batch_deletes row per deleted source row
//     (a statement-level AFTER DELETE trigger reading the statement's
//     transition table: one INSERT … SELECT per DELETE statement) and one
//     per TRUNCATE.
//   - The drain: the transaction that creates a run (prepareRun) reads the
//     captures of the table past the job's mark (batch_delete_marks) up to
//     the newest one, and turns the live normalized rows among them into
//     tombstones and delete events exactly as the sweep does (last version
//     + 1, vanished), whether or not the id is in the source again: a
//     re-inserted row has a change value past the previous run's boundary,
//     so this run or the next reads it and it wins over the vanished
//     tombstone whatever its version (upsertTail, migration 011). A
//     TRUNCATE tombstones every live row of the source name; the rows
//     written since come back the same way.
//   - The exits: the same transaction reads the source rows whose change
//     value lies past the job's exit mark, up to the table's newest value,
//     and that are out of scope now (filter, explicit partition list), and
//     tombstones their live normalized rows: an UPDATE that moves a row
//     out of scope gives it a new change value.
//
// The marks are fixed after the writers open when the run's boundaries
// were read have ended (so every capture of a transaction whose changes
// the run reads is below the mark), and then the writers open at that
// point are waited for too (so no capture or change value below the marks
// commits later): the same rule as the boundaries'. Tombstones, events and
// the new marks commit with the run's creation, under the job lock, in
// one transaction: a crash anywhere loses no delete and writes none twice.

// Failpoints of the drain, inside the transaction that creates the run.
const (
	failpointDeletesAfterTombstones = "batch.deletes_after_tombstones" // tombstones and events written, marks not moved
	failpointDeletesAfterMark       = "batch.deletes_after_mark"       // + marks moved, not committed
	failpointDeletesAfterCommit     = "batch.deletes_after_commit"     // the run and its drain committed
)

// CaptureTrigger is the name of the statement-level AFTER DELETE trigger
// [FollowTriggerSQL] installs on the source table.
const CaptureTrigger = "outboxrelay_capture_delete"

// CaptureTruncateTrigger is the name of the AFTER TRUNCATE trigger beside
// [CaptureTrigger].
const CaptureTruncateTrigger = "outboxrelay_capture_truncate"

// CaptureRekeyTrigger is the name of the row-level AFTER UPDATE OF id
// trigger beside [CaptureTrigger]: an UPDATE that changes a row's id
// deletes the old id. Installs before it lack it; runs do not require it.
const CaptureRekeyTrigger = "outboxrelay_capture_rekey"

// captureTriggerSQL is the part of [FollowTriggerSQL] that captures deletes
// and truncates into batch_deletes. The function is the table's own (its
// name carries a hash of the table), so its INSERT is static SQL whose plan
// each session caches: a generic function with EXECUTE format(…) made 20000
// single-row deletes take about 2.5 times as long. It runs as its owner
// (SECURITY DEFINER: the installer, who can write batch_deletes) with the
// installer's search_path, so a writer needs no grant on batch_deletes and
// finds it whatever its own search_path is. It writes the table's own
// name, not TG_TABLE_NAME: on a partitioned table the triggers are on
// every partition too (a statement that names a partition fires only the
// partition's statement triggers), and a partition's capture is the
// table's, and a TRUNCATE of a partition is captured as a marker that
// makes the drain tombstone the rows no longer in the table. A partition created
// later needs the SQL run again; until then incremental runs refuse to
// start (captureMissingSQL). A partition detached or dropped is no
// statement on its rows: nothing is captured. An UPDATE that changes a
// row's id is captured as the delete of the old id, by a row trigger
// whose WHEN clause PostgreSQL checks only when the id is in the SET list.
func captureTriggerSQL(s Spec) string {
	table := q(s.Source.Schema, s.Source.Table)
	h := sha256.Sum256([]byte(s.Source.Schema + "\x00" + s.Source.Table))
	fn := q("outboxrelay_capture_" + hex.EncodeToString(h[:8]))
	schemaLit, tableLit := sqlLiteral(s.Source.Schema), sqlLiteral(s.Source.Table)
	deleteTrigger := func(on string) string {
		return `CREATE OR REPLACE TRIGGER ` + CaptureTrigger + ` AFTER DELETE ON ` + on + `
    REFERENCING OLD TABLE AS outboxrelay_deleted FOR EACH STATEMENT EXECUTE FUNCTION ` + fn + `()`
	}
	truncateTrigger := func(on string) string {
		return `CREATE OR REPLACE TRIGGER ` + CaptureTruncateTrigger + ` AFTER TRUNCATE ON ` + on + `
    FOR EACH STATEMENT EXECUTE FUNCTION ` + fn + `()`
	}
	// A TRUNCATE of a partition is no TRUNCATE of the table: its capture
	// is a marker (no id, not truncated), and the drain then tombstones the
	// rows no longer in the table. (Reading the partition's ids in a BEFORE
	// TRUNCATE trigger would make a TRUNCATE of the whole table, which
	// fires its partitions' triggers too, copy every id.)
	fnPart := q("outboxrelay_capture_" + hex.EncodeToString(h[:8]) + "_part")
	// An UPDATE that changes the id deletes the old one.
	fnRekey := q("outboxrelay_capture_" + hex.EncodeToString(h[:8]) + "_rekey")
	id := q(s.Source.ID)
	return `CREATE OR REPLACE FUNCTION ` + fn + `() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        INSERT INTO batch_deletes (source_schema, source_table, truncated) VALUES (` + schemaLit + `, ` + tableLit + `, true);
    ELSE
        INSERT INTO batch_deletes (source_schema, source_table, source_id)
        SELECT ` + schemaLit + `, ` + tableLit + `, o.` + id + `::text FROM outboxrelay_deleted o;
    END IF;
    RETURN NULL;
END $$;
` + deleteTrigger(table) + `;
` + truncateTrigger(table) + `;
CREATE OR REPLACE FUNCTION ` + fnRekey + `() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    INSERT INTO batch_deletes (source_schema, source_table, source_id) VALUES (` + schemaLit + `, ` + tableLit + `, OLD.` + id + `::text);
    RETURN NULL;
END $$;
-- A row trigger that fires only when the id is in the SET list and
-- changed (on a partitioned table PostgreSQL puts it on every partition).
CREATE OR REPLACE TRIGGER ` + CaptureRekeyTrigger + ` AFTER UPDATE OF ` + id + ` ON ` + table + `
    FOR EACH ROW WHEN (OLD.` + id + ` IS DISTINCT FROM NEW.` + id + `) EXECUTE FUNCTION ` + fnRekey + `();
-- The same, and the follow NOTIFY, on the partitions of a partitioned table.
CREATE OR REPLACE FUNCTION ` + fnPart + `() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    INSERT INTO batch_deletes (source_schema, source_table) VALUES (` + schemaLit + `, ` + tableLit + `);
    RETURN NULL;
END $$;
DO $outboxrelay_partitions$
DECLARE p regclass;
BEGIN
    FOR p IN SELECT relid FROM pg_partition_tree(to_regclass(` + sqlLiteral(table) + `)) WHERE relid <> to_regclass(` + sqlLiteral(table) + `) LOOP
        EXECUTE format($sql$` + deleteTrigger("%s") + `$sql$, p);
        EXECUTE format($sql$CREATE OR REPLACE TRIGGER ` + CaptureTruncateTrigger + ` AFTER TRUNCATE ON %s
    FOR EACH STATEMENT EXECUTE FUNCTION ` + fnPart + `()$sql$, p);
        EXECUTE format($sql$CREATE OR REPLACE TRIGGER outboxrelay_follow AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON %s
    FOR EACH STATEMENT EXECUTE FUNCTION outboxrelay_follow_notify()$sql$, p);
    END LOOP;
END $outboxrelay_partitions$;
`
}

const (
	// captureMissingSQL lists table $1 and those of its partitions that do
	// not have both capture triggers enabled (a trigger disabled or enabled
	// for replicas only never fires in a writer's session): none when the
	// capture is installed.
	captureMissingSQL = `SELECT coalesce(array_agg(m.relid::regclass::text ORDER BY m.relid::regclass::text), '{}')
FROM (SELECT to_regclass($1)::oid AS relid UNION SELECT relid::oid FROM pg_partition_tree(to_regclass($1))) m
WHERE (SELECT count(*) FROM pg_trigger t WHERE t.tgrelid = m.relid
       AND t.tgname IN ('` + CaptureTrigger + `', '` + CaptureTruncateTrigger + `') AND t.tgenabled IN ('O', 'A')) < 2`
	// newestCaptureSQL: the newest committed capture of table ($1, $2).
	newestCaptureSQL = `SELECT max(id) FROM batch_deletes WHERE source_schema = $1 AND source_table = $2`
	// deleteMarksSQL: job $1's marks, when they are for table ($2, $3).
	deleteMarksSQL = `SELECT capture_id, exit_mark FROM batch_delete_marks WHERE job = $1 AND source_schema = $2 AND source_table = $3`
	// saveDeleteMarksSQL moves job $1's marks.
	saveDeleteMarksSQL = `
INSERT INTO batch_delete_marks (job, source_schema, source_table, capture_id, exit_mark, tombstones)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (job) DO UPDATE SET source_schema = EXCLUDED.source_schema, source_table = EXCLUDED.source_table,
    capture_id = EXCLUDED.capture_id, exit_mark = EXCLUDED.exit_mark,
    tombstones = CASE WHEN batch_delete_marks.source_schema = EXCLUDED.source_schema AND batch_delete_marks.source_table = EXCLUDED.source_table
                      THEN batch_delete_marks.tombstones ELSE 0 END + EXCLUDED.tombstones,
    updated_at = now()`
	// dropDeleteMarksSQL: a job that no longer drains (vanished: keep)
	// holds back no capture.
	dropDeleteMarksSQL = `DELETE FROM batch_delete_marks WHERE job = $1`
	// purgeCapturesSQL deletes the captures of table ($1, $2) that every
	// draining job of the table has passed.
	purgeCapturesSQL = `DELETE FROM batch_deletes WHERE source_schema = $1 AND source_table = $2
  AND id <= (SELECT min(capture_id) FROM batch_delete_marks WHERE source_schema = $1 AND source_table = $2)`
	// purgeUnreadCapturesSQL deletes the captures of table ($1, $2) older
	// than an hour when no job drains the table (only vanished: keep jobs
	// read it), so they do not pile up; the hour leaves a job that starts
	// draining the table meanwhile its captures.
	purgeUnreadCapturesSQL = `DELETE FROM batch_deletes WHERE source_schema = $1 AND source_table = $2
  AND captured_at < now() - interval '1 hour'
  AND NOT EXISTS (SELECT FROM batch_delete_marks WHERE source_schema = $1 AND source_table = $2)`
	// pendingDeletesSQL: whether table ($1, $2) has a capture past job $3's
	// mark (what the follower waits for beside a new change value).
	pendingDeletesSQL = `SELECT EXISTS (SELECT FROM batch_deletes d WHERE d.source_schema = $1 AND d.source_table = $2
  AND d.id > COALESCE((SELECT m.capture_id FROM batch_delete_marks m WHERE m.job = $3 AND m.source_schema = $1 AND m.source_table = $2), 0))`
)

// drainSQL tombstones the live normalized rows of the captures in
// (capfrom, capto] (every live row when one of them is a TRUNCATE; those
// no longer in the table when one is a partition's TRUNCATE) and of
// the source rows out of scope whose change value is in (exitfrom, exitto]
// (withFrom false: up to exitto; withExits false, for a full run, which has
// no change column and sweeps: none), with one delete event each. It
// returns the tombstones written. A soft-deleted row among them (already a
// tombstone) gets no new event but is marked vanished like the others, so
// that a row inserted again with its version reset comes back above its
// tombstone (upsertTail) instead of being refused below it for good.
func (c *compiled) drainSQL(withFrom, withExits bool) stmt {
	b := newBuilder()
	exits := ""
	if withExits {
		filter := *c
		filter.spec.Source.Partition = ""
		scope := filter.scopeWhere(b)
		if p := c.spec.Source.Partition; p != "" && len(c.spec.Source.Partitions) > 0 {
			scope += " AND s." + q(p) + " = ANY(" + b.p("pkeys", "text[]") + "::" + c.types[p] + "[])"
		}
		col, typ := "s."+q(c.spec.Source.Cursor[0]), c.types[c.spec.Source.Cursor[0]]
		exits = col + " <= " + b.p("exitto", "text") + "::" + typ
		if withFrom {
			exits = col + " > " + b.p("exitfrom", "text") + "::" + typ + " AND " + exits
		}
		exits = `
  UNION
  SELECT s.` + q(c.spec.Source.ID) + `::text FROM ` + c.table + ` s WHERE ` + exits + ` AND (` + scope + `) IS NOT TRUE`
	}
	schema, table := b.c(c.spec.Source.Schema, "text"), b.c(c.spec.Source.Table, "text")
	sql := `
WITH cap AS MATERIALIZED (
  SELECT d.source_id, d.truncated FROM batch_deletes d
  WHERE d.source_schema = ` + schema + ` AND d.source_table = ` + table + `
    AND d.id > ` + b.p("capfrom", "bigint") + ` AND d.id <= ` + b.p("capto", "bigint") + `
), ids AS MATERIALIZED (
  SELECT source_id FROM cap WHERE source_id IS NOT NULL` + exits + `
  UNION
  SELECT n.source_id FROM normalized_records n
  WHERE n.source = ` + b.p("source", "text") + ` AND NOT n.vanished AND EXISTS (SELECT FROM cap WHERE cap.truncated)
  UNION
  -- A partition truncated (a marker: no id, not truncated): the rows no
  -- longer in the table, one anti-join over it.
  SELECT n.source_id FROM normalized_records n
  WHERE n.source = ` + b.p("source", "text") + ` AND NOT n.vanished
    AND EXISTS (SELECT FROM cap WHERE cap.source_id IS NULL AND NOT cap.truncated)
    AND NOT EXISTS (SELECT FROM cap WHERE cap.truncated)
    AND NOT EXISTS (SELECT FROM ` + c.table + ` s WHERE s.` + q(c.spec.Source.ID) + `::text = n.source_id)
), gone AS (
  UPDATE normalized_records n SET vanished = true, updated_at = now()
  FROM ids
  WHERE n.source = ` + b.p("source", "text") + ` AND n.source_id = ids.source_id AND n.deleted AND NOT n.vanished
), up AS (
  UPDATE normalized_records n
  SET document = NULL, deleted = true, source_version = n.source_version + 1,
      processor_version = ` + b.p("pv", "text") + `, vanished = true, updated_at = now()
  FROM ids
  WHERE n.source = ` + b.p("source", "text") + ` AND n.source_id = ids.source_id AND NOT n.deleted
  RETURNING n.source_id, n.source_version, n.document, n.deleted
),
` + c.outboxCTE(b, false) + `
SELECT count(*) FROM up`
	return b.stmt(sql)
}

// drainDeletes is the drain of a new run with vanished: delete (see the
// comment at the top of this file), in tx, the transaction that creates the
// run, after the open writers of the boundaries were waited for. An
// incremental job needs the capture; a full job drains the captures only
// when the table has it (its sweep finds the rest, but a row deleted and
// inserted again with a lower version between two runs needs the
// tombstone first to come back). firstLoad: normalized_records holds no
// row of the source name, so a job without marks only sets them. It
// returns the tombstones written and whether it drained (false: a full job
// whose table has no capture).
func drainDeletes(ctx context.Context, tx pgx.Tx, ow openWriters, c *compiled, firstLoad bool) (n int64, drained bool, err error) {
	s := c.spec
	schema, table := s.Source.Schema, s.Source.Table
	var missing []string
	if err := tx.QueryRow(ctx, captureMissingSQL, c.table).Scan(&missing); err != nil {
		return 0, false, fmt.Errorf("job %s: look for the delete capture on %s: %w", s.Job, c.table, err)
	}
	installed := len(missing) == 0
	if !installed && s.Mode == ModeFull {
		if _, err := tx.Exec(ctx, dropDeleteMarksSQL, s.Job); err != nil {
			return 0, false, fmt.Errorf("job %s: drop the delete marks: %w", s.Job, err)
		}
		return 0, false, nil
	}
	if !installed {
		return 0, false, fmt.Errorf("%w: job %s: vanished: delete on an incremental job needs the delete capture on %s (triggers %s and %s, enabled; "+
			"on a partitioned table on every partition too), and %s lacks it: "+
			"install it with `batcher follow-trigger --install` (batch.FollowTriggerSQL; again after creating a partition), or set vanished: keep",
			ErrSpec, s.Job, c.table, CaptureTrigger, CaptureTruncateTrigger, strings.Join(missing, ", "))
	}
	var capTo *int64
	if err := tx.QueryRow(ctx, newestCaptureSQL, schema, table).Scan(&capTo); err != nil {
		return 0, false, fmt.Errorf("job %s: read the newest delete capture: %w", s.Job, err)
	}
	var exitTo *string
	exits := s.Mode == ModeIncremental
	if exits {
		if err := tx.QueryRow(ctx, `SELECT max(`+q(s.Source.Cursor[0])+`)::text FROM `+c.table).Scan(&exitTo); err != nil {
			return 0, false, fmt.Errorf("job %s: read the newest %s: %w", s.Job, s.Source.Cursor[0], err)
		}
	}
	// A capture or a change value below the marks may belong to a writer
	// still open: wait for those too (later writers take higher values).
	if err := waitForOpenWriters(ctx, tx, ow, s.Job, c.table); err != nil {
		return 0, false, err
	}
	var capFrom int64
	var exitFrom *string
	found := true
	err = tx.QueryRow(ctx, deleteMarksSQL, s.Job, schema, table).Scan(&capFrom, &exitFrom)
	if errors.Is(err, pgx.ErrNoRows) {
		found, err = false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("job %s: read the delete marks: %w", s.Job, err)
	}
	newCap := capFrom
	if capTo != nil && *capTo > capFrom {
		newCap = *capTo
	}
	newExit := exitFrom
	if exitTo != nil {
		newExit = exitTo
	}
	if found || !firstLoad {
		st := c.drainSQL(exitFrom != nil, exits)
		a := &args{Source: s.SourceName, PV: s.ProcessorVersion, PKeys: s.Source.Partitions, CapFrom: capFrom, CapTo: newCap, ExitFrom: exitFrom, ExitTo: newExit}
		if err := tx.QueryRow(ctx, st.sql, st.bind(a)...).Scan(&n); err != nil {
			return 0, false, fmt.Errorf("job %s: tombstone the deleted rows: %w", s.Job, err)
		}
	}
	hit(failpointDeletesAfterTombstones)
	if _, err := tx.Exec(ctx, saveDeleteMarksSQL, s.Job, schema, table, newCap, newExit, n); err != nil {
		return 0, false, fmt.Errorf("job %s: move the delete marks: %w", s.Job, err)
	}
	hit(failpointDeletesAfterMark)
	if _, err := tx.Exec(ctx, purgeCapturesSQL, schema, table); err != nil {
		return 0, false, fmt.Errorf("job %s: delete the drained captures: %w", s.Job, err)
	}
	return n, true, nil
}

// DeleteMarks is where a job's drain of deletes stands, as `batcher
// status` shows it.
type DeleteMarks struct {
	Job   string
	Table string // schema.table
	// CaptureID is the last batch_deletes.id drained; ExitMark the last
	// change value whose out-of-scope rows were tombstoned (nil: none).
	CaptureID  int64
	ExitMark   *string
	Tombstones int64 // written by the drains so far
	// Pending counts the captures of the table past CaptureID.
	Pending   int64
	UpdatedAt time.Time
}

const deleteMarksStatusSQL = `
SELECT m.job, m.source_schema || '.' || m.source_table, m.capture_id, m.exit_mark, m.tombstones,
       (SELECT count(*) FROM batch_deletes d WHERE d.source_schema = m.source_schema AND d.source_table = m.source_table AND d.id > m.capture_id),
       m.updated_at
FROM batch_delete_marks m WHERE $1 = '' OR m.job = $1 ORDER BY m.job`

// ListDeleteMarks lists the drain marks of job ("" = every job).
func ListDeleteMarks(ctx context.Context, db DB, job string) ([]DeleteMarks, error) {
	rows, err := db.Query(ctx, deleteMarksStatusSQL, job)
	if err != nil {
		return nil, fmt.Errorf("read the delete marks: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeleteMarks, error) {
		var m DeleteMarks
		err := r.Scan(&m.Job, &m.Table, &m.CaptureID, &m.ExitMark, &m.Tombstones, &m.Pending, &m.UpdatedAt)
		return m, err
	})
}

// ReadDeleteMarks reads job's drain marks; ok is false when the job has
// none (no vanished: delete job with the capture, or no run yet).
func ReadDeleteMarks(ctx context.Context, db DB, job string) (m DeleteMarks, ok bool, err error) {
	if job == "" {
		return m, false, fmt.Errorf("read the delete marks: no job")
	}
	ms, err := ListDeleteMarks(ctx, db, job)
	if err != nil || len(ms) == 0 {
		return m, false, err
	}
	return ms[0], true, nil
}
