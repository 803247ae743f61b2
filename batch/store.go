package batch

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DB is the database handle the package's functions take: a
// *pgxpool.Pool, a *pgx.Conn or a pgx.Tx (whose Begin is a savepoint).
// Only [NewRunner] takes a *pgxpool.Pool: its workers hold connections of
// their own, as many as the pool's size allows.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Begin(ctx context.Context) (pgx.Tx, error)
}

// querier is the part of a [DB] that runs statements.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// StartOptions choose which run a Runner works on.
type StartOptions struct {
	// RunID names the logical run. "" = the job's unfinished run if there is
	// one, else a new run.
	RunID string
	// Restart starts a new run from the beginning; the unfinished one is
	// marked superseded. Needed when the processor version or scope changed.
	Restart bool
	// Resume continues a run made by another processor version when the
	// spec lists that version in compatible_versions.
	Resume bool
	// Rebuild declares a run at a processor version that was the job's
	// live one before and is not now (see [LiveVersionError]): it rebuilds
	// that version's index generation beside the live one (e.g. v2 again
	// after a rollback to v1). A version never live needs no declaration.
	Rebuild bool
}

// documentsByPVKey is the key of batch_jobs.spec that holds, per processor
// version, the document section the job last ran with (not part of Spec:
// LoadJobSpec leaves it out).
const documentsByPVKey = "documents_by_processor_version"

type storedPartition struct {
	key, state, pv, scopeHash string
	scope                     json.RawMessage
}

// prepareRun finds or creates the run, checks it is compatible with the
// spec, and resets failed partitions to pending (a new `run` is the retry).
// It returns the run id.
func prepareRun(ctx context.Context, db beginner, c *compiled, opts StartOptions, now time.Time, ow openWriters) (string, error) {
	s := c.spec
	scope := s.Scope()
	tx, err := db.Begin(ctx)
	if err != nil {
		return "", err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if _, err := tx.Exec(ctx, lockJobSQL, s.Job); err != nil {
		return "", fmt.Errorf("lock job %s: %w", s.Job, err)
	}
	if err := checkLiveVersion(ctx, tx, s, opts); err != nil {
		return "", err
	}
	if err := checkDocumentUnchanged(ctx, tx, s, opts); err != nil {
		return "", err
	}
	if err := checkSharedSourceName(ctx, tx, s); err != nil {
		return "", err
	}
	specJSON, _ := json.Marshal(s)
	docJSON, _ := json.Marshal(s.Document)
	if _, err := tx.Exec(ctx, saveJobSQL, s.Job, specJSON, s.ProcessorVersion, docJSON); err != nil {
		return "", fmt.Errorf("save spec of job %s: %w", s.Job, err)
	}
	runID := opts.RunID
	if runID == "" {
		// The newest run that is not finished.
		err := tx.QueryRow(ctx, unfinishedRunSQL, s.Job).Scan(&runID)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return "", fmt.Errorf("find run of job %s: %w", s.Job, err)
		}
		if runID == "" {
			// The newest run's partitions are done, its sweep may not be.
			err := tx.QueryRow(ctx, unfinishedSweepRunSQL, s.Job).Scan(&runID)
			if err != nil && !errors.Is(err, pgx.ErrNoRows) {
				return "", fmt.Errorf("find run of job %s: %w", s.Job, err)
			}
		}
	}
	var parts []storedPartition
	if runID != "" {
		rows, err := tx.Query(ctx, loadRunSQL, s.Job, runID)
		if err != nil {
			return "", err
		}
		for rows.Next() {
			var p storedPartition
			if err := rows.Scan(&p.key, &p.state, &p.pv, &p.scopeHash, &p.scope); err != nil {
				return "", err
			}
			parts = append(parts, p)
		}
		if err := rows.Err(); err != nil {
			return "", fmt.Errorf("load run %s/%s: %w", s.Job, runID, err)
		}
	}
	if (len(parts) > 0 || (runID != "" && opts.RunID == "")) && opts.Restart {
		if _, err := tx.Exec(ctx, supersedeRunSQL, s.Job, runID); err != nil {
			return "", err
		}
		if _, err := tx.Exec(ctx, supersedeSweepSQL, s.Job, runID); err != nil {
			return "", err
		}
		parts, runID = nil, ""
	}
	if len(parts) > 0 {
		p := parts[0]
		if p.scopeHash != scope.Hash() {
			return "", &IncompatibleError{
				Problem: fmt.Sprintf("run %s of job %s was started with scope %s, the spec now gives %s", runID, s.Job, compactJSON(p.scope), scope.JSON()),
				remedy: func(restart, _ string) string {
					return "a checkpoint cannot be reused for another scope: rerun with " + restart + " to start a new run from the beginning, or restore the spec"
				},
			}
		}
		if p.pv != s.ProcessorVersion {
			if !opts.Resume || !slices.Contains(s.CompatibleVersions, p.pv) {
				compatible, pv := slices.Contains(s.CompatibleVersions, p.pv), p.pv
				return "", &IncompatibleError{
					Problem: fmt.Sprintf("run %s of job %s was made with processor version %s, the spec has %s", runID, s.Job, p.pv, s.ProcessorVersion),
					remedy: func(restart, resume string) string {
						hint := "rerun with " + restart + " to start a new run from the beginning"
						if compatible {
							return hint + ", or with " + resume + " to continue it (the spec declares " + pv + " compatible)"
						}
						return hint + ", or declare " + pv + " in compatible_versions and pass " + resume + " if its results stay valid"
					},
				}
			}
			if _, err := tx.Exec(ctx, resumeVersionSQL, s.Job, runID, s.ProcessorVersion); err != nil {
				return "", err
			}
			if _, err := tx.Exec(ctx, auditResumeSQL,
				s.Job, runID, actor(), "processor version "+p.pv+" -> "+s.ProcessorVersion+" declared compatible"); err != nil {
				return "", err
			}
		}
		if _, err := tx.Exec(ctx, rerunPartitionsSQL, s.Job, runID); err != nil {
			return "", fmt.Errorf("rerun the failed partitions of %s/%s: %w", s.Job, runID, err)
		}
		if _, err := tx.Exec(ctx, sweepOnResumeSQL(s), s.Job, runID); err != nil {
			return "", err
		}
		return runID, tx.Commit(ctx)
	}
	if opts.RunID != "" && runID == opts.RunID && s.Document.HasRelations() {
		// A new run named by the caller beside an unfinished one would
		// rebuild the same documents at once (relations.go: rebuilds of a
		// root must not overlap).
		var other string
		err := tx.QueryRow(ctx, unfinishedRunSQL, s.Job).Scan(&other)
		if errors.Is(err, pgx.ErrNoRows) {
			err = tx.QueryRow(ctx, unfinishedSweepRunSQL, s.Job).Scan(&other)
		}
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return "", fmt.Errorf("find run of job %s: %w", s.Job, err)
		}
		if other != "" {
			return "", &IncompatibleError{
				Problem: fmt.Sprintf("run %s of job %s is not finished, and a second run of a job whose documents join related tables would rebuild the same documents beside it", other, s.Job),
				remedy: func(restart, _ string) string {
					return "finish it (run the job without a run id), or rerun without a run id and with " + restart + " to supersede it"
				},
			}
		}
	}
	if runID != "" && opts.RunID == "" {
		// A run without partitions (none in scope at start) whose sweep is
		// not over.
		if _, err := tx.Exec(ctx, sweepOnResumeSQL(s), s.Job, runID); err != nil {
			return "", err
		}
		return runID, tx.Commit(ctx)
	}
	if runID == "" {
		runID = now.UTC().Format("20060102T150405.000Z")
	}
	keys := []string{""}
	if s.Source.Partition != "" {
		keys = s.Source.Partitions
		if len(keys) == 0 {
			keys = nil
			rows, err := tx.Query(ctx, c.partitions.sql, c.partitions.bind(&args{})...)
			if err != nil {
				return "", fmt.Errorf("list partitions of job %s: %w", s.Job, err)
			}
			keys, err = pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				return "", fmt.Errorf("list partitions of job %s: %w", s.Job, err)
			}
			if len(keys) == 0 {
				keys = []string{}
			}
		}
	}
	boundaries := make([][]string, len(keys))
	starts := make([][]string, len(keys))
	for i, key := range keys {
		var start []string
		if s.Mode == ModeIncremental && !opts.Restart {
			// An incremental run starts where the previous one's boundary
			// was; a restart starts from the beginning.
			err := tx.QueryRow(ctx, previousBoundarySQL,
				s.Job, key, s.ProcessorVersion, scope.Hash()).Scan(&start)
			if err != nil && !errors.Is(err, pgx.ErrNoRows) {
				return "", err
			}
			if err := c.checkSequencesPast(ctx, tx, key, start); err != nil {
				return "", err
			}
		}
		var boundary []string
		st := from(c.boundary, start)
		if err := tx.QueryRow(ctx, st.sql, st.bind(&args{Start: start, PKey: key})...).Scan(&boundary); err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return "", fmt.Errorf("capture boundary of %s/%s/%s: %w", s.Job, runID, key, err)
		}
		starts[i], boundaries[i] = start, boundary
	}
	// A transaction still open when the boundaries were read may yet commit
	// rows below them (a sequence value or a created_at taken before the
	// rows that set the boundary committed). The run's cursor would pass
	// them before they are visible, and an incremental next run starts at
	// this boundary: they would never be read. So wait for them now; every
	// transaction that starts later orders after the boundary.
	if err := waitForOpenWriters(ctx, tx, ow, s.Job, pgx.Identifier{cmpOr(s.Source.Schema, "public"), s.Source.Table}.Sanitize()); err != nil {
		return "", err
	}
	// A first load sweeps nothing, and its chunks write with plain INSERTs.
	var firstLoad bool
	if err := tx.QueryRow(ctx, sourceEmptySQL, s.SourceName).Scan(&firstLoad); err != nil {
		return "", fmt.Errorf("create run %s/%s: %w", s.Job, runID, err)
	}
	for i, key := range keys {
		start, boundary := starts[i], boundaries[i]
		var estimate *int64
		state := "pending"
		if boundary == nil {
			state = "succeeded" // nothing in scope at start
		} else {
			estimate = estimateRows(ctx, tx, c, &args{Start: start, Boundary: boundary, PKey: key})
		}
		_, err := tx.Exec(ctx, createPartitionSQL,
			s.Job, runID, key, state, s.Mode, start, boundary, s.ProcessorVersion, scope.Hash(), scope.JSON(), estimate, s.Chunk.Size, firstLoad)
		if err != nil {
			return "", fmt.Errorf("create run %s/%s/%s: %w", s.Job, runID, key, err)
		}
	}
	// A job with vanished: delete turns the deletes captured since its
	// last run into tombstones now, before its chunks read the rows written
	// since (deletes.go).
	drained := false
	if s.Vanished == VanishedDelete {
		if _, drained, err = drainDeletes(ctx, tx, ow, c, firstLoad); err != nil {
			return "", err
		}
	} else {
		if _, err := tx.Exec(ctx, dropDeleteMarksSQL, s.Job); err != nil {
			return "", fmt.Errorf("job %s: drop the delete marks: %w", s.Job, err)
		}
		if _, err := tx.Exec(ctx, purgeUnreadCapturesSQL, s.Source.Schema, s.Source.Table); err != nil {
			return "", fmt.Errorf("job %s: delete the unread delete captures: %w", s.Job, err)
		}
	}
	var queued int64
	if len(c.rels) > 0 {
		if queued, err = prepareRelations(ctx, tx, c, runID, opts.Restart); err != nil {
			return "", err
		}
	}
	if s.Vanished == VanishedDelete && s.Mode == ModeFull {
		// A first load sweeps nothing: its sweep would only read every row
		// it just wrote back, and probe the source for each (17 of 41 s of a
		// 1M-row first run).
		sweep := createSweepSQL
		if firstLoad {
			sweep = createSweptSQL
		}
		if _, err := tx.Exec(ctx, sweep, s.Job, runID); err != nil {
			return "", fmt.Errorf("create the sweep of run %s/%s: %w", s.Job, runID, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return "", err
	}
	if drained {
		hit(failpointDeletesAfterCommit)
	}
	ow.metrics.relationRoots(s.Job, "queued", queued)
	return runID, nil
}

// checkDocumentUnchanged refuses a changed document section under the
// processor version the job last ran with: the upsert guard would see the
// same source and processor version for every row and write nothing, so
// the change would silently never reach the index. StartOptions.Resume declares the
// change compatible (existing documents stay as they are), and is audited.
//
// The document each processor version last ran with is kept beside the
// spec (batch_jobs.spec, key documentsByPVKey), so going back to an
// earlier version (after a rollback) with another document is refused
// too: that version's generation already holds every row at its source
// version.
func checkDocumentUnchanged(ctx context.Context, tx pgx.Tx, s Spec, opts StartOptions) error {
	var stored Spec
	var ranWith *Document
	err := tx.QueryRow(ctx, storedDocumentSQL, s.Job, s.ProcessorVersion).Scan(&stored, &ranWith)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("load stored spec of job %s: %w", s.Job, err)
	}
	if ranWith == nil && stored.ProcessorVersion == s.ProcessorVersion {
		ranWith = &stored.Document // stored before documents were kept per version
	}
	if ranWith == nil || ranWith.Hash() == s.Document.Hash() {
		return nil
	}
	changes := DocumentChanges(*ranWith, s.Document)
	if !opts.Resume {
		return &IncompatibleError{
			Problem: fmt.Sprintf("the document section of job %s changed but processor_version is still %s (%s)", s.Job, s.ProcessorVersion, strings.Join(changes, "; ")),
			remedy: func(_, resume string) string {
				return "rows already normalized would not be rebuilt: bump processor_version to rebuild every document into a new index generation, " +
					"or rerun with " + resume + " to declare the change compatible (existing documents stay as they are)"
			},
		}
	}
	if _, err := tx.Exec(ctx, auditDocumentSQL,
		s.Job, actor(), "document changed under processor version "+s.ProcessorVersion+", declared compatible: "+strings.Join(changes, "; ")); err != nil {
		return fmt.Errorf("audit document change of job %s: %w", s.Job, err)
	}
	return nil
}

// openWriters is what waitForOpenWriters needs besides the run start's
// transaction: where to say that it waits (db, outside that transaction),
// how long to wait at most (negative: no limit), and the metrics.
type openWriters struct {
	db       querier
	wait     time.Duration
	metrics  *Metrics
	follower bool // the caller tries again after giving up
}

// openWritersShown is how long a run start waits before it says so in
// batch_open_writers (most waits last milliseconds, and are not worth two
// writes); openWritersRefresh is how often it renews checked_at then.
const (
	openWritersShown   = time.Second
	openWritersRefresh = 5 * time.Second
)

// waitForOpenWriters waits until every transaction that held a write lock
// on the source table when it was called has ended: a writer holds a
// RowExclusiveLock (or stronger) on the table from the start of its first
// INSERT, UPDATE or DELETE until it commits or rolls back, which covers the
// nextval() defaults and BEFORE triggers an INSERT evaluates before it has
// a transaction id. Each writer is known by its virtual transaction id (a
// prepared transaction by its "-1/xid"), and the wait polls pg_locks, which
// is read afresh by every statement (pg_stat_activity would stay frozen for
// the rest of the transaction). Transactions that take the lock later
// order after the boundary (see the incremental mode's requirements on the
// change column in [Source]) and do not delay the run.
//
// A wait that lasts is recorded in batch_open_writers (over ow.db, so other
// sessions see it) and the row is deleted in tx once the writers are gone;
// past ow.wait it returns an [OpenWritersError] (tx is then rolled back by
// the caller, releasing the job lock) and leaves the row, marked expired.
func waitForOpenWriters(ctx context.Context, tx pgx.Tx, ow openWriters, job, table string) error {
	type writer struct {
		VXID string
		Pid  *int32
	}
	describe := func(ws []writer) []string {
		desc := make([]string, len(ws))
		for i, w := range ws {
			desc[i] = w.VXID
			if w.Pid != nil {
				desc[i] += " (pid " + strconv.Itoa(int(*w.Pid)) + ")"
			}
		}
		return desc
	}
	rows, err := tx.Query(ctx, openWritersSQL, table, nil)
	if err != nil {
		return fmt.Errorf("list open writers of %s: %w", table, err)
	}
	writers, err := pgx.CollectRows(rows, pgx.RowToStructByPos[writer])
	if err != nil {
		return fmt.Errorf("list open writers of %s: %w", table, err)
	}
	if len(writers) > 0 {
		vxids := make([]string, len(writers))
		for i, w := range writers {
			vxids[i] = w.VXID
		}
		started := time.Now()
		var shown time.Time // when batch_open_writers was last written
		for wait := 5 * time.Millisecond; ; wait = min(wait*2, 200*time.Millisecond) {
			rows, err := tx.Query(ctx, openWritersSQL, table, vxids)
			if err != nil {
				return fmt.Errorf("watch open writers of %s: %w", table, err)
			}
			open, err := pgx.CollectRows(rows, pgx.RowToStructByPos[writer])
			if err != nil {
				return fmt.Errorf("watch open writers of %s: %w", table, err)
			}
			if len(open) == 0 {
				break
			}
			waited := time.Since(started)
			expired := ow.wait >= 0 && waited > ow.wait
			if expired || (shown.IsZero() && waited >= openWritersShown) || (!shown.IsZero() && time.Since(shown) >= openWritersRefresh) {
				if _, err := ow.db.Exec(ctx, openWritersWaitingSQL, job, table, strings.Join(describe(open), ", "), waited.Seconds(), expired, ow.follower); err != nil {
					return fmt.Errorf("record the wait of job %s for open writers of %s: %w", job, table, err)
				}
				shown = time.Now()
			}
			if expired {
				if ow.metrics != nil {
					ow.metrics.OpenWritersExpired.WithLabelValues(job).Inc()
				}
				return &OpenWritersError{Job: job, Table: table, Writers: describe(open), Wait: ow.wait}
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(wait):
			}
		}
	}
	// The run starts: it waits no more (nor did an earlier attempt that
	// gave up, for the writers it waited for have ended too).
	if _, err := tx.Exec(ctx, openWritersDoneSQL, job); err != nil {
		return fmt.Errorf("clear the wait of job %s for open writers: %w", job, err)
	}
	return nil
}

type beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

func compactJSON(b []byte) string { return strings.Join(strings.Fields(string(b)), "") }

// estimateRows counts the rows in range for the progress line and status:
// exactly when that takes under two seconds, else the planner's estimate.
func estimateRows(ctx context.Context, tx pgx.Tx, c *compiled, a *args) *int64 {
	if sp, err := tx.Begin(ctx); err == nil {
		var n int64
		_, err := sp.Exec(ctx, estimateTimeoutSQL)
		if err == nil {
			st := from(c.count, a.Start)
			err = sp.QueryRow(ctx, st.sql, st.bind(a)...).Scan(&n)
		}
		// Rolling the savepoint back also undoes the local timeout; the count
		// wrote nothing.
		if rerr := sp.Rollback(ctx); err == nil && rerr == nil {
			return &n
		}
	}
	st := from(c.estimate, a.Start)
	var plan []struct {
		Plan struct {
			Rows float64 `json:"Plan Rows"`
		} `json:"Plan"`
	}
	var raw []byte
	if err := tx.QueryRow(ctx, st.sql, st.bind(a)...).Scan(&raw); err != nil {
		return nil
	}
	if json.Unmarshal(raw, &plan) != nil || len(plan) == 0 {
		return nil
	}
	n := int64(plan[0].Plan.Rows)
	return &n
}

// prepareRelations readies a new run of a relation job (relations.go). A
// full run rebuilds every root, so it drops the captures and work it can
// see (each committed before the run's chunks read anything). An
// incremental run needs the capture triggers; it resolves the captures
// into work for its relation phase, which runs in its sweep (created when
// there is work).
func prepareRelations(ctx context.Context, tx pgx.Tx, c *compiled, runID string, restart bool) (queued int64, err error) {
	s := c.spec
	if s.Mode == ModeFull || restart {
		// A restart reads every root again, too (and its ids may be of
		// another column now).
		if _, err := tx.Exec(ctx, relForgetSQL, s.Job); err != nil {
			return 0, fmt.Errorf("job %s: drop the relation captures a full run covers: %w", s.Job, err)
		}
		if s.Mode == ModeFull {
			return 0, nil
		}
	}
	if err := c.checkRelationTriggers(ctx, tx); err != nil {
		return 0, err
	}
	var captures int64
	if err := tx.QueryRow(ctx, c.resolveRel.sql, c.resolveRel.bind(&args{Job: s.Job})...).Scan(&captures, &queued); err != nil {
		return 0, fmt.Errorf("job %s: resolve the related changes into roots: %w", s.Job, err)
	}
	var work bool
	if err := tx.QueryRow(ctx, relWorkExistsSQL, s.Job).Scan(&work); err != nil {
		return 0, fmt.Errorf("job %s: read the relation work: %w", s.Job, err)
	}
	if work {
		if _, err := tx.Exec(ctx, createSweepSQL, s.Job, runID); err != nil {
			return 0, fmt.Errorf("create the relation phase of run %s/%s: %w", s.Job, runID, err)
		}
	}
	return queued, nil
}
