package batch

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// FollowChannel is the NOTIFY channel of the trigger [FollowTriggerSQL]
// installs; the payload names the table that changed.
const FollowChannel = "outboxrelay_follow"

// DefaultFollowPoll is [FollowConfig].PollInterval's default.
const DefaultFollowPoll = time.Second

// DefaultFollowMinInterval is [FollowConfig].MinInterval's default.
const DefaultFollowMinInterval = 100 * time.Millisecond

// FollowConfig configures a [Follower]. Zero values take the defaults named
// on each field.
type FollowConfig struct {
	// PollInterval is how often an idle follower looks for changes when no
	// NOTIFY arrives: the only wake-up without the trigger (or with PollOnly),
	// a fallback with it. Each look is one max() over the change column.
	// Default 1s.
	PollInterval time.Duration
	// PollOnly turns LISTEN off (behind PgBouncer in transaction mode,
	// which cannot LISTEN): changes are found by polling only.
	PollOnly bool
	// MinInterval is the least time from one run's start to the next's
	// while the table keeps changing. Each run costs the database a few
	// dozen statements and a commit whatever it carries, and so does the
	// publisher's read of what it wrote; without a floor, a table changing
	// every few milliseconds gets a run (of one or two rows) every few
	// milliseconds. With it, a busy table's changes wait up to MinInterval
	// and go in one run; a run that took longer than MinInterval is
	// followed at once. Default 100ms; negative: no floor.
	MinInterval time.Duration
}

// FollowSummary says what a [Follower.Run] did.
type FollowSummary struct {
	Runs    int64 // runs this follower ran (or resumed)
	Chunks  int64
	Rows    int64 // source rows committed by this process
	Changed int64
	// Quarantined rows, by this process.
	Quarantined int64
	// LastRunID is the last run worked on; after a soft stop in the middle
	// of a run, that run is unfinished and the next follower resumes it.
	LastRunID string
}

// Follower runs an incremental job continuously: one run after another,
// each a normal run of a [Runner] (its own snapshot boundary, fenced
// leases, one transaction per chunk). It starts the next run at once while
// the source has changes past what the last run covered, and otherwise
// waits for a NOTIFY on [FollowChannel] naming its table (see
// [FollowTriggerSQL]) or the poll interval, whichever comes first. An idle
// follower runs one cheap query per poll interval and creates no runs.
//
// Only incremental jobs can be followed: a full run reads every row in
// scope, so following one would rescan the whole table for every change.
type Follower struct {
	pool *pgxpool.Pool
	spec Spec
	cfg  Config
	fc   FollowConfig
	log  *slog.Logger

	name     string          // the table as quote_ident would name it (NOTIFY payload)
	related  map[string]bool // the related and join tables, named so
	latestQ  string          // max change value now, and the server's clock
	newerQ   string          // whether a change past $1 exists
	wakes    chan struct{}
	listenOn bool
}

// NewFollower checks that the job can be followed and the configs; the
// database checks happen in [Follower.Run]. cfg.RunID, cfg.MaxChunks and
// cfg.Partition must be unset (every run is a new one; a follower does not stop by
// itself); cfg.Restart applies to the first run only.
func NewFollower(pool *pgxpool.Pool, spec Spec, cfg Config, fc FollowConfig) (*Follower, error) {
	spec = spec.withDefaults()
	switch {
	case spec.Mode != ModeIncremental:
		return nil, fmt.Errorf("%w: job %s has mode %s: only an incremental job can be followed (a full run reads every row in scope, so following it would rescan the table for every change)",
			ErrSpec, spec.Job, spec.Mode)
	case cfg.RunID != "":
		return nil, fmt.Errorf("follow job %s: run id %s: a follower starts a new run each time; leave the run id unset", spec.Job, cfg.RunID)
	case cfg.MaxChunks != 0:
		return nil, fmt.Errorf("follow job %s: max chunks %d: a follower does not stop by itself; leave it 0", spec.Job, cfg.MaxChunks)
	case cfg.Partition != "":
		// A run is finished when all its partitions are, and the next run
		// starts only then: a follower of one partition would finish its
		// own and wait for the others for good.
		return nil, fmt.Errorf("follow job %s: partition %s: a follower works on every partition of its runs; leave the partition unset and start several followers, which share the partitions through leases", spec.Job, cfg.Partition)
	case fc.PollInterval < 0:
		return nil, fmt.Errorf("follow job %s: poll interval %s: want > 0 (0 = default %s)", spec.Job, fc.PollInterval, DefaultFollowPoll)
	}
	fc.PollInterval = cmp.Or(fc.PollInterval, DefaultFollowPoll)
	fc.MinInterval = cmp.Or(fc.MinInterval, DefaultFollowMinInterval)
	cfg.Progress = nil // a progress line per run says little
	// The same checks as every run's.
	if _, err := NewRunner(pool, spec, cfg); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	cfg.compiles = &compileCache{}
	table := q(spec.Source.Schema, spec.Source.Table)
	col := "s." + q(spec.Source.Cursor[0])
	return &Follower{
		pool: pool, spec: spec, cfg: cfg, fc: fc, log: cfg.Logger.With(slog.String("job", spec.Job)),
		latestQ:  `SELECT max(` + col + `)::text, now() FROM ` + table + ` s`,
		newerQ:   `SELECT COALESCE(max(` + col + `) > $1::text::%s, max(` + col + `) IS NOT NULL) FROM ` + table + ` s`,
		wakes:    make(chan struct{}, 1),
		listenOn: !fc.PollOnly,
	}, nil
}

// FollowTriggerSQL is the statement-level trigger that wakes followers of
// the spec's table: after every INSERT, UPDATE, DELETE or TRUNCATE it sends
// a NOTIFY on [FollowChannel] whose payload names the table. PostgreSQL
// sends it at commit (not at all on rollback) and folds a transaction's
// repeats into one, so it costs a writer one notification per transaction.
// It also installs the delete capture (triggers outboxrelay_capture_delete
// and outboxrelay_capture_truncate): a statement-level AFTER DELETE trigger
// that copies the deleted ids from the statement's transition table into
// batch_deletes with one INSERT … SELECT, and an AFTER TRUNCATE one that
// records the truncate, in the writer's transaction; incremental jobs with
// vanished: delete drain them (see [Spec].Vanished).
// Needs PostgreSQL 14 or newer (CREATE OR REPLACE TRIGGER); running it again
// is harmless.
func FollowTriggerSQL(spec Spec) string {
	spec = spec.withDefaults()
	return `CREATE OR REPLACE FUNCTION outboxrelay_follow_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('` + FollowChannel + `', quote_ident(TG_TABLE_SCHEMA) || '.' || quote_ident(TG_TABLE_NAME));
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER outboxrelay_follow AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON ` + q(spec.Source.Schema, spec.Source.Table) + `
    FOR EACH STATEMENT EXECUTE FUNCTION outboxrelay_follow_notify();
` + captureTriggerSQL(spec)
}

// FollowTriggerSQLFor is [FollowTriggerSQL] for any spec: for a job whose
// documents join related tables it adds, on every related and join table,
// the follow NOTIFY and the relation capture triggers (relations.go),
// whose joins it reads from the catalog where the spec leaves them out.
func FollowTriggerSQLFor(ctx context.Context, db DB, spec Spec) (string, error) {
	spec = spec.withDefaults()
	sql := FollowTriggerSQL(spec)
	if !spec.Document.HasRelations() {
		return sql, nil
	}
	c, err := compile(ctx, db, spec)
	if err != nil {
		return "", err
	}
	leaves, err := c.relLeaves(ctx, db)
	if err != nil {
		return "", err
	}
	return sql + c.relationTriggerSQL(leaves), nil
}

// UnindexedJoins lists the join columns of the spec's relations that no
// index leads with, each with the statement that adds one: without it,
// rebuilding a document or finding the documents of a changed row scans
// the table. Nothing for a spec without relations.
func UnindexedJoins(ctx context.Context, db DB, spec Spec) ([]string, error) {
	spec = spec.withDefaults()
	if !spec.Document.HasRelations() {
		return nil, nil
	}
	c, err := compile(ctx, db, spec)
	if err != nil {
		return nil, err
	}
	return c.unindexedJoins(ctx, db)
}

// RelationTables names the related and join tables of the spec's
// documents (schema.table), in spec order.
func RelationTables(spec Spec) []string {
	var out []string
	for _, t := range relationTables(spec) {
		out = append(out, t[0]+"."+t[1])
	}
	return out
}

// relationTables is RelationTables as (schema, table) pairs: a schema's
// name may hold a dot.
func relationTables(spec Spec) [][2]string {
	spec = spec.withDefaults()
	var out [][2]string
	seen := map[[2]string]bool{}
	var walk func([]Relation)
	walk = func(rs []Relation) {
		for _, r := range rs {
			for _, t := range [][2]string{{r.Schema, r.Table}, {throughSchema(r), throughTable(r)}} {
				if t[1] != "" && !seen[t] {
					seen[t] = true
					out = append(out, t)
				}
			}
			walk(r.Relations)
		}
	}
	walk(spec.Document.Relations)
	return out
}

func throughSchema(r Relation) string {
	if r.Through == nil {
		return ""
	}
	return r.Through.Schema
}

func throughTable(r Relation) string {
	if r.Through == nil {
		return ""
	}
	return r.Through.Table
}

// Run follows the job until soft is cancelled (the run in flight stops at a
// chunk boundary as [Runner.Run] does; the next follower resumes that run)
// or hard is (the chunk in flight rolls back), and returns nil then. A run
// that fails (a partition failed for good, a lost lease, an incompatible
// checkpoint) ends the follower with its error; a run start that gave up
// waiting for open writers ([ErrOpenWriters]) does not: it is logged and
// tried again after the poll interval (at most 30s), for as long as the
// writers stay open.
func (f *Follower) Run(soft, hard context.Context) (*FollowSummary, error) {
	sum := &FollowSummary{}
	if err := f.prepare(hard); err != nil {
		return sum, err
	}
	lctx, stopListen := context.WithCancel(hard)
	defer stopListen()
	listening := make(chan struct{})
	if f.listenOn {
		go f.listen(lctx, listening)
		// LISTEN before the first look at the table, so no change that
		// commits after it goes unnoticed.
		select {
		case <-listening:
		case <-soft.Done():
			return sum, nil
		}
	}
	opts := f.cfg.StartOptions
	var (
		mark    *string // every change up to this value was covered by a finished run
		known   bool    // mark is set
		started time.Time
	)
	for {
		if soft.Err() != nil {
			return sum, nil
		}
		if known {
			if err := f.waitForChange(soft, hard, mark); err != nil || soft.Err() != nil {
				return sum, err
			}
		}
		// Changes that keep coming within MinInterval of the last run's
		// start go into one run.
		if wait := f.fc.MinInterval - time.Since(started); !started.IsZero() && wait > 0 && !f.sleep(soft, wait) {
			return sum, nil
		}
		started = time.Now()
		select {
		case <-f.wakes: // this look covers whatever woke us so far
		default:
		}
		var before *string
		var at time.Time
		if err := f.pool.QueryRow(hard, f.latestQ).Scan(&before, &at); err != nil {
			return sum, fmt.Errorf("follow job %s: read the newest %s: %w", f.spec.Job, f.spec.Source.Cursor[0], err)
		}
		cfg := f.cfg
		cfg.StartOptions = opts
		cfg.follower = true
		opts.Restart = false
		r, err := NewRunner(f.pool, f.spec, cfg)
		if err != nil {
			return sum, err
		}
		rs, err := r.Run(soft, hard)
		if rs != nil {
			sum.Runs++
			sum.Chunks += rs.Chunks
			sum.Rows += rs.Rows
			sum.Changed += rs.Changed
			sum.Quarantined += rs.Quarantined
			sum.LastRunID = cmp.Or(rs.RunID, sum.LastRunID)
		}
		if errors.Is(err, ErrOpenWriters) {
			// A long writer delays the run, and the follower waits it out:
			// the start's transaction (and the job lock) is given up, and
			// the next attempt reads new boundaries. batch_open_writers
			// keeps the wait's since across the attempts.
			retry := min(f.fc.PollInterval, 30*time.Second)
			f.log.Warn("follow: the run did not start; trying again", slog.String("error", err.Error()), slog.Duration("retry_in", retry))
			known = false
			if !f.sleep(soft, retry) {
				return sum, nil
			}
			continue
		}
		if err != nil {
			return sum, err
		}
		if soft.Err() != nil || hard.Err() != nil {
			return sum, nil
		}
		if rs.RunID != "" {
			f.log.Debug("run finished", slog.String("run", rs.RunID), slog.Bool("done", rs.Done), slog.Int64("rows", rs.Rows))
		}
		if !rs.Done {
			// Not every partition succeeded and none was left to claim: an
			// operator paused one, or another worker holds it. Look again
			// after a poll interval rather than at once.
			known = false
			if !f.pause(soft, nil) {
				return sum, nil
			}
			continue
		}
		// The run covers every change up to before only if this follower's
		// Prepare created it after before was read; a run it resumed (one
		// an earlier follower left unfinished) has an older boundary.
		created, err := f.createdSince(hard, rs.RunID, at)
		if err != nil {
			return sum, err
		}
		mark, known = before, created
		if created {
			// Every value taken after before was read is above it, and
			// the writers open when the run read its boundaries committed
			// before it started; but one of those may have committed a
			// value below before and above its partition's boundary
			// (another partition, or a row outside the filter, held the
			// table's newest value). Such a change would wait for the
			// next write anywhere: look for it now.
			past, err := r.changesPast(hard)
			if err != nil {
				return sum, err
			}
			known = !past
		}
	}
}

// runEndsSQL lists run $2's partitions with where each ended: its
// boundary, or its start when it had nothing to read.
const runEndsSQL = `SELECT partition_key, COALESCE(boundary, start_cursor) FROM batch_runs WHERE job = $1 AND logical_run_id = $2`

// changesPast reports whether a row in scope has a change value past where
// its partition ended in the run r worked on, or is in a partition the run
// did not have: what the next run would read.
func (r *Runner) changesPast(ctx context.Context) (bool, error) {
	rows, err := r.pool.Query(ctx, runEndsSQL, r.spec.Job, r.runID)
	if err != nil {
		return false, fmt.Errorf("follow job %s: read the ends of run %s: %w", r.spec.Job, r.runID, err)
	}
	ends := map[string][]string{}
	var key string
	var end []string
	if _, err := pgx.ForEachRow(rows, []any{&key, &end}, func() error { ends[key] = end; return nil }); err != nil {
		return false, fmt.Errorf("follow job %s: read the ends of run %s: %w", r.spec.Job, r.runID, err)
	}
	keys := []string{""}
	if r.spec.Source.Partition != "" {
		keys = r.spec.Source.Partitions
		if len(keys) == 0 {
			rows, err := r.pool.Query(ctx, r.c.partitions.sql, r.c.partitions.bind(&args{})...)
			if err != nil {
				return false, fmt.Errorf("follow job %s: list partitions: %w", r.spec.Job, err)
			}
			if keys, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
				return false, fmt.Errorf("follow job %s: list partitions: %w", r.spec.Job, err)
			}
		}
	}
	for _, key := range keys {
		var next []string
		st := from(r.c.boundary, ends[key])
		err := r.pool.QueryRow(ctx, st.sql, st.bind(&args{Start: ends[key], PKey: key})...).Scan(&next)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return false, fmt.Errorf("follow job %s: look past partition %q: %w", r.spec.Job, key, err)
		}
		if next != nil {
			return true, nil
		}
	}
	return false, nil
}

// prepare reads the change column's type (for the comparison with a stored
// value) and how NOTIFY names the table.
func (f *Follower) prepare(ctx context.Context) error {
	var typ *string
	err := f.pool.QueryRow(ctx, followColumnSQL, q(f.spec.Source.Schema, f.spec.Source.Table), f.spec.Source.Cursor[0], f.spec.Source.Schema, f.spec.Source.Table).Scan(&typ, &f.name)
	if err != nil {
		return fmt.Errorf("follow job %s: read source.cursor[0] of %s.%s: %w", f.spec.Job, f.spec.Source.Schema, f.spec.Source.Table, err)
	}
	if typ == nil {
		return fmt.Errorf("%w: follow job %s: source.cursor[0] %q is not a column of %s.%s", ErrSpec, f.spec.Job, f.spec.Source.Cursor[0], f.spec.Source.Schema, f.spec.Source.Table)
	}
	f.newerQ = fmt.Sprintf(f.newerQ, *typ) // a type name read back from the catalog
	missing, err := UnindexedJoins(ctx, f.pool, f.spec)
	if err != nil {
		return err
	}
	for _, m := range missing {
		f.log.Warn("a join column of the job's relations has no index", slog.String("column", m))
	}
	// A write that names a partition fires the partition's trigger, whose
	// NOTIFY names the partition.
	f.related = map[string]bool{}
	for _, t := range append([][2]string{{f.spec.Source.Schema, f.spec.Source.Table}}, relationTables(f.spec)...) {
		schema, table := t[0], t[1]
		var names []string
		if err := f.pool.QueryRow(ctx, notifyNamesSQL, schema, table).Scan(&names); err != nil {
			return fmt.Errorf("follow job %s: name %s.%s: %w", f.spec.Job, schema, table, err)
		}
		for _, n := range names {
			f.related[n] = true
		}
	}
	return nil
}

// notifyNamesSQL: how the follow NOTIFY names table ($1, $2) and each of
// its partitions (quote_ident of schema and table).
const notifyNamesSQL = `SELECT array_agg(quote_ident(n.nspname) || '.' || quote_ident(c.relname))
FROM (SELECT to_regclass(quote_ident($1) || '.' || quote_ident($2))::oid AS relid
      UNION SELECT relid::oid FROM pg_partition_tree(to_regclass(quote_ident($1) || '.' || quote_ident($2)))) m
JOIN pg_class c ON c.oid = m.relid JOIN pg_namespace n ON n.oid = c.relnamespace`

// waitForChange returns once the change column has a value past mark (or
// any value when mark is NULL), looking after each wake-up and poll
// interval; it returns nil at once when soft is cancelled.
func (f *Follower) waitForChange(soft, hard context.Context, mark *string) error {
	for {
		select {
		case <-f.wakes:
		default:
		}
		var newer bool
		if err := f.pool.QueryRow(hard, f.newerQ, mark).Scan(&newer); err != nil {
			return fmt.Errorf("follow job %s: look for changes: %w", f.spec.Job, err)
		}
		if !newer && f.spec.Vanished == VanishedDelete {
			// A delete leaves no change value: its capture is the change.
			err := f.pool.QueryRow(hard, pendingDeletesSQL, f.spec.Source.Schema, f.spec.Source.Table, f.spec.Job).Scan(&newer)
			if err != nil {
				return fmt.Errorf("follow job %s: look for deletes: %w", f.spec.Job, err)
			}
		}
		if !newer && f.spec.Document.HasRelations() {
			// A related row's change leaves no change value on the root:
			// its capture (or work a run left) is the change.
			if err := f.pool.QueryRow(hard, relPendingSQL, f.spec.Job).Scan(&newer); err != nil {
				return fmt.Errorf("follow job %s: look for related changes: %w", f.spec.Job, err)
			}
		}
		if newer {
			return nil
		}
		if !f.pause(soft, f.wakes) {
			return nil
		}
	}
}

// pause waits one poll interval, or less when wake fires; false when soft
// was cancelled.
func (f *Follower) pause(soft context.Context, wake <-chan struct{}) bool {
	t := time.NewTimer(f.fc.PollInterval)
	defer t.Stop()
	select {
	case <-soft.Done():
		return false
	case <-wake:
	case <-t.C:
	}
	return true
}

// sleep waits d; false when soft was cancelled first.
func (f *Follower) sleep(soft context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-soft.Done():
		return false
	case <-t.C:
		return true
	}
}

// createdSince reports whether the run's partitions were created at or
// after at (the server's clock). A run without partitions (none in scope)
// counts as created.
func (f *Follower) createdSince(ctx context.Context, run string, at time.Time) (bool, error) {
	var ok *bool
	err := f.pool.QueryRow(context.WithoutCancel(ctx), runCreatedSinceSQL, f.spec.Job, run, at).Scan(&ok)
	if err != nil {
		return false, fmt.Errorf("follow job %s: read run %s: %w", f.spec.Job, run, err)
	}
	return ok == nil || *ok, nil
}

// listen holds a session connection LISTENing on FollowChannel and signals
// wakes for each notification naming the table; ready is closed once the
// first LISTEN is in place (or has failed: polling covers then). A lost
// connection is reopened with backoff (up to 30s apart, every attempt
// logged) while polling goes on, and a wake follows each reconnect: changes
// may have committed meanwhile.
func (f *Follower) listen(ctx context.Context, ready chan struct{}) {
	readyOnce := func() {
		select {
		case <-ready:
		default:
			close(ready)
		}
	}
	b := backoff.NewExponentialBackOff(backoff.WithInitialInterval(100*time.Millisecond), backoff.WithMaxInterval(30*time.Second), backoff.WithMaxElapsedTime(0))
	for ctx.Err() == nil {
		err := f.listenOnce(ctx, func() { b.Reset(); readyOnce(); f.wake() })
		readyOnce()
		if ctx.Err() != nil {
			return
		}
		d := b.NextBackOff()
		f.log.Warn("follow: LISTEN connection lost; polling meanwhile", slog.String("error", err.Error()), slog.Duration("retry_in", d))
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

func (f *Follower) listenOnce(ctx context.Context, listening func()) error {
	pc, err := f.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	// A LISTENing session must not go back to the pool.
	conn := pc.Hijack()
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{FollowChannel}.Sanitize()); err != nil {
		return fmt.Errorf("LISTEN %s: %w", FollowChannel, err)
	}
	listening()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		if n.Payload == f.name || f.related[n.Payload] {
			f.wake()
		}
	}
}

func (f *Follower) wake() {
	select {
	case f.wakes <- struct{}{}:
	default:
	}
}
