package manifest

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Current state of a committed item in Report.
const (
	ItemMatching = "matching" // the row is as the chunk left it
	ItemDrifted  = "drifted"  // the row changed since
	ItemMissing  = "missing"  // no row with this id any more
)

// Report tells what a job approved, committed and has left, and the
// current state of each committed item. Completion is read from the
// progress and audit, never from what a client printed.
type Report struct {
	Job Job `json:"job"`
	// Approved lists every id of the frozen list, in list order.
	Approved []string `json:"approved"`
	// Committed lists the ids before next_index (changed and audited);
	// Unprocessed the rest.
	Committed   []string `json:"committed"`
	Unprocessed []string `json:"unprocessed"`
	// Matching, Drifted and Missing split Committed by the current row.
	// A committed id stays committed whatever happened to its row later.
	Matching []string `json:"matching"`
	Drifted  []string `json:"drifted"`
	Missing  []string `json:"missing"`
	Drift    []Drift  `json:"drift"`
	// Verification lists the problems progress verification finds (empty
	// when next_index and the audit agree with the frozen list).
	Verification []string  `json:"verification"`
	ReadAt       time.Time `json:"read_at"`
}

// Drift says how a drifted item differs from what its chunk left.
type Drift struct {
	ID          string   `json:"id"`
	Differences []string `json:"differences"`
}

// reportHook, when set by a test, runs between the report's statements.
var reportHook func(jobID string)

// ReadReport builds the report of a job. The progress, the audit, its
// verification and the current target rows are read in one REPEATABLE READ
// read-only transaction, so they come from one snapshot: a chunk that
// commits meanwhile is in none of them.
func ReadReport(ctx context.Context, db DB, jobID string) (Report, error) {
	tx, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return Report{}, fmt.Errorf("manifest job %s: report: begin: %w", jobID, err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, reportSettingsSQL); err != nil {
		return Report{}, fmt.Errorf("manifest job %s: report: %w", jobID, err)
	}
	rep, err := readReport(ctx, tx, jobID)
	if err != nil {
		return rep, err
	}
	return rep, tx.Commit(ctx)
}

func readReport(ctx context.Context, db querier, jobID string) (Report, error) {
	job, err := loadJob(ctx, db, selectJobSQL, jobID)
	if err != nil {
		return Report{}, err
	}
	target, err := resolveTarget(ctx, db, job.Target)
	if err != nil {
		return Report{}, fmt.Errorf("manifest job %s: %w", jobID, err)
	}
	rep := Report{
		Approved: []string{}, Committed: []string{}, Unprocessed: []string{},
		Matching: []string{}, Drifted: []string{}, Missing: []string{}, Drift: []Drift{},
		Verification: []string{},
	}
	rows, err := db.Query(ctx, target.report, target.keyArgs(jobID)...)
	if err != nil {
		return rep, fmt.Errorf("manifest job %s: report: %w", jobID, err)
	}
	var (
		nextIndex, seq       int32
		state, id            string
		audited, found       bool
		wantRev, rev         int64
		wantFields, cur      map[string]json.RawMessage
		curTenant, curStatus string
		badKeys              []string
	)
	_, err = pgx.ForEachRow(rows, []any{&nextIndex, &state, &seq, &id, &audited, &wantRev, &wantFields, &found, &curTenant, &rev, &curStatus, &cur, &badKeys}, func() error {
		rep.Approved = append(rep.Approved, id)
		if int(seq) >= job.NextIndex {
			rep.Unprocessed = append(rep.Unprocessed, id)
			return nil
		}
		rep.Committed = append(rep.Committed, id)
		if !found {
			rep.Missing = append(rep.Missing, id)
			return nil
		}
		want := rowState{found: true, tenant: job.Tenant, revision: wantRev, status: job.Transition.To, fields: wantFields}
		got := rowState{found: true, tenant: curTenant, revision: rev, status: curStatus, fields: cur}
		diffs := compareRow(want, got, badKeys, "committed", "now")
		if len(diffs) == 0 {
			rep.Matching = append(rep.Matching, id)
			return nil
		}
		rep.Drifted = append(rep.Drifted, id)
		rep.Drift = append(rep.Drift, Drift{ID: id, Differences: diffs})
		return nil
	})
	if err != nil {
		return rep, fmt.Errorf("manifest job %s: report: %w", jobID, err)
	}
	rep.Job = job
	rep.ReadAt = time.Now().UTC()
	if reportHook != nil {
		reportHook(jobID)
	}
	problems, err := verifyProgress(ctx, db, job, 0)
	if err != nil {
		return rep, err
	}
	rep.Verification = append(rep.Verification, problems...)
	return rep, nil
}

// String renders the report as text for a terminal.
func (r Report) String() string {
	var b strings.Builder
	j := r.Job
	fmt.Fprintf(&b, "job          %s\n", j.JobID)
	fmt.Fprintf(&b, "tenant       %s\n", j.Tenant)
	fmt.Fprintf(&b, "target       %s (%s → %s, revision + 1)\n", j.Target.Table, j.Transition.From, j.Transition.To)
	fmt.Fprintf(&b, "state        %s\n", j.State)
	fmt.Fprintf(&b, "progress     %d of %d items (chunk size %d)\n", j.NextIndex, j.ItemCount, j.ChunkSize)
	if j.Conflict != nil {
		fmt.Fprintf(&b, "conflict     %s\n", j.Conflict)
	}
	if len(r.Verification) == 0 {
		fmt.Fprintf(&b, "verification ok (audit agrees with next_index and the approved list)\n")
	} else {
		fmt.Fprintf(&b, "verification FAILED: %s\n", strings.Join(r.Verification, "; "))
	}
	list := func(name string, ids []string) {
		fmt.Fprintf(&b, "%-12s %d", name, len(ids))
		if len(ids) > 0 {
			fmt.Fprintf(&b, ": %s", strings.Join(ids, " "))
		}
		b.WriteByte('\n')
	}
	list("approved", r.Approved)
	list("committed", r.Committed)
	list("unprocessed", r.Unprocessed)
	list("  matching", r.Matching)
	list("  drifted", r.Drifted)
	list("  missing", r.Missing)
	for _, d := range r.Drift {
		fmt.Fprintf(&b, "    %s: %s\n", d.ID, strings.Join(d.Differences, ", "))
	}
	return b.String()
}
