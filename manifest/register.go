package manifest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Job is a registered job as manifest_jobs holds it.
type Job struct {
	JobID      string     `json:"job_id"`
	Tenant     string     `json:"tenant"`
	Target     Target     `json:"target"`
	Transition Transition `json:"transition"`
	Topic      string     `json:"topic"`
	IDType     string     `json:"id_type"`
	ChunkSize  int        `json:"chunk_size"`
	ItemCount  int        `json:"item_count"`
	NextIndex  int        `json:"next_index"`
	State      string     `json:"state"`
	ChunksDone int        `json:"chunks_done"`
	// Conflict says why the job is conflicted (nil otherwise).
	Conflict   *Conflict  `json:"conflict,omitempty"`
	CreatedAt  time.Time  `json:"created_at"`
	UpdatedAt  time.Time  `json:"updated_at"`
	FinishedAt *time.Time `json:"finished_at,omitempty"`

	itemsHash, contentHash string
}

func scanJob(row pgx.Row) (Job, error) {
	var j Job
	var spec []byte
	var conflict []byte
	err := row.Scan(&j.JobID, &j.Tenant, &spec, &j.ChunkSize, &j.ItemCount, &j.itemsHash, &j.contentHash,
		&j.NextIndex, &j.State, &conflict, &j.ChunksDone, &j.CreatedAt, &j.UpdatedAt, &j.FinishedAt)
	if err != nil {
		return j, err
	}
	var h storedHeader
	if err := json.Unmarshal(spec, &h); err != nil {
		return j, fmt.Errorf("manifest job %s: stored spec: %w", j.JobID, err)
	}
	j.Target, j.Transition, j.Topic, j.IDType = h.Target, h.Transition, h.Topic, h.IDType
	if conflict != nil {
		j.Conflict = &Conflict{}
		if err := json.Unmarshal(conflict, j.Conflict); err != nil {
			return j, fmt.Errorf("manifest job %s: stored conflict: %w", j.JobID, err)
		}
	}
	return j, nil
}

func loadJob(ctx context.Context, q querier, sql, jobID string) (Job, error) {
	j, err := scanJob(q.QueryRow(ctx, sql, jobID))
	if errors.Is(err, pgx.ErrNoRows) {
		return j, fmt.Errorf("%w: %q", ErrNotFound, jobID)
	}
	if err != nil {
		return j, fmt.Errorf("load manifest job %s: %w", jobID, err)
	}
	return j, nil
}

// ListJobs returns every registered job, oldest first.
func ListJobs(ctx context.Context, db DB) ([]Job, error) {
	rows, err := db.Query(ctx, listJobsSQL)
	if err != nil {
		return nil, fmt.Errorf("list manifest jobs: %w", err)
	}
	defer rows.Close()
	var out []Job
	for rows.Next() {
		j, err := scanJob(rows)
		if err != nil {
			return nil, fmt.Errorf("list manifest jobs: %w", err)
		}
		out = append(out, j)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list manifest jobs: %w", err)
	}
	return out, nil
}

// GetJob returns one job.
func GetJob(ctx context.Context, db DB, jobID string) (Job, error) {
	return loadJob(ctx, db, selectJobSQL, jobID)
}

// Registration says what Register did.
type Registration struct {
	// Created is false when the same job was registered before (the call
	// was a no-op).
	Created bool `json:"created"`
	Job     Job  `json:"job"`
}

// RegistrationConflictError lists what differs between a file and
// the job registered under its id. It wraps ErrRegistrationConflict.
type RegistrationConflictError struct {
	JobID       string
	Differences []string
}

func (e *RegistrationConflictError) Error() string {
	return fmt.Sprintf("manifest job %q is already registered with a different %s; nothing changed (register the new approval under a new job id)",
		e.JobID, strings.Join(e.Differences, ", "))
}

func (e *RegistrationConflictError) Unwrap() error { return ErrRegistrationConflict }

// Register freezes an approved list (normalized by Parse).
// The same job id with the same content, in any item order, is the same job:
// nothing changes and Created is false. The same job id with another tenant,
// target, transition, topic, chunk size or items is a
// *RegistrationConflictError and nothing changes. The target table
// and columns must exist.
func Register(ctx context.Context, db DB, spec Spec) (Registration, error) {
	if spec.Topic == "" || spec.IDType == "" {
		return Registration{}, fmt.Errorf("%w: register a spec returned by Parse", ErrInvalid)
	}
	target, err := resolveTarget(ctx, db, spec.Target)
	if err != nil {
		return Registration{}, fmt.Errorf("register manifest job %s: %w", spec.JobID, err)
	}
	itemsHash, contentHash := spec.hashes()
	header, err := json.Marshal(spec.header())
	if err != nil {
		return Registration{}, err
	}
	n := len(spec.Items)
	seqs, ids, revs, fields := make([]int32, n), make([]string, n), make([]int64, n), make([]string, n)
	for i, it := range spec.Items {
		f, err := json.Marshal(it.Fields)
		if err != nil {
			return Registration{}, fmt.Errorf("items[%d] (id %s): fields: %w", i, it.ID, err)
		}
		seqs[i], ids[i], revs[i], fields[i] = int32(i), it.ID, it.Revision, string(f)
	}

	var bad int
	if err := db.QueryRow(ctx, target.checkFields, fields).Scan(&bad); err != nil {
		return Registration{}, fmt.Errorf("%w: register manifest job %s: the items' fields %v do not compare as the types of %s's columns: %v",
			ErrInvalid, spec.JobID, spec.Target.MatchFields, target.table, err)
	}

	var reg Registration
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var got string
		err := tx.QueryRow(ctx, insertJobSQL, spec.JobID, spec.Tenant, header, spec.ChunkSize, n, itemsHash, contentHash).Scan(&got)
		switch {
		case err == nil:
			if _, err := tx.Exec(ctx, insertItemsSQL, spec.JobID, seqs, ids, revs, fields); err != nil {
				return fmt.Errorf("insert %d items: %w", n, err)
			}
			reg.Created = true
		case errors.Is(err, pgx.ErrNoRows):
			// Registered before (or by a concurrent call that committed
			// first: ON CONFLICT waited for it).
		default:
			return fmt.Errorf("insert job: %w", err)
		}
		reg.Job, err = loadJob(ctx, tx, selectJobSQL, spec.JobID)
		if err != nil || reg.Created || reg.Job.contentHash == contentHash {
			return err
		}
		diffs, err := differences(ctx, tx, reg.Job, spec, itemsHash)
		if err != nil {
			return err
		}
		return &RegistrationConflictError{JobID: spec.JobID, Differences: diffs}
	})
	if err != nil {
		var ce *RegistrationConflictError
		if errors.As(err, &ce) {
			return Registration{}, err
		}
		return Registration{}, fmt.Errorf("register manifest job %s: %w", spec.JobID, err)
	}
	return reg, nil
}

// differences names what differs between the stored job and spec.
func differences(ctx context.Context, q querier, job Job, spec Spec, itemsHash string) ([]string, error) {
	var d []string
	if job.Tenant != spec.Tenant {
		d = append(d, fmt.Sprintf("tenant (registered %q, file %q)", job.Tenant, spec.Tenant))
	}
	if job.ChunkSize != spec.ChunkSize {
		d = append(d, fmt.Sprintf("chunk size (registered %d, file %d)", job.ChunkSize, spec.ChunkSize))
	}
	if a, b := jsonString(job.Target), jsonString(spec.Target); a != b {
		d = append(d, fmt.Sprintf("target (registered %s, file %s)", a, b))
	}
	if job.Transition != spec.Transition {
		d = append(d, fmt.Sprintf("transition (registered %s → %s, file %s → %s)", job.Transition.From, job.Transition.To, spec.Transition.From, spec.Transition.To))
	}
	if job.Topic != spec.Topic {
		d = append(d, fmt.Sprintf("topic (registered %q, file %q)", job.Topic, spec.Topic))
	}
	if job.IDType != spec.IDType {
		d = append(d, fmt.Sprintf("id type (registered %ss, file %ss)", job.IDType, spec.IDType))
	}
	if job.itemsHash != itemsHash {
		d = append(d, "items ("+firstItemDifference(ctx, q, job, spec)+")")
	}
	if len(d) == 0 {
		d = append(d, "content hash")
	}
	return d, nil
}

func firstItemDifference(ctx context.Context, q querier, job Job, spec Spec) string {
	rows, err := q.Query(ctx, selectItemsSQL, job.JobID)
	if err != nil {
		return fmt.Sprintf("registered %d, file %d", job.ItemCount, len(spec.Items))
	}
	stored, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Item, error) {
		var it Item
		var f []byte
		if err := r.Scan(&it.ID, &it.Revision, &f); err != nil {
			return it, err
		}
		return it, json.Unmarshal(f, &it.Fields)
	})
	if err != nil {
		return fmt.Sprintf("registered %d, file %d", job.ItemCount, len(spec.Items))
	}
	prefix := fmt.Sprintf("registered %d, file %d", len(stored), len(spec.Items))
	for i := range min(len(stored), len(spec.Items)) {
		a, b := stored[i], spec.Items[i]
		switch {
		case a.ID != b.ID:
			return fmt.Sprintf("%s; first difference at position %d: registered id %s, file id %s", prefix, i, a.ID, b.ID)
		case a.Revision != b.Revision:
			return fmt.Sprintf("%s; id %s: registered revision %d, file %d", prefix, a.ID, a.Revision, b.Revision)
		case !sameFields(a.Fields, b.Fields):
			return fmt.Sprintf("%s; id %s: registered fields %s, file %s", prefix, a.ID, jsonString(a.Fields), jsonString(b.Fields))
		}
	}
	return prefix
}

func sameFields(a, b map[string]json.RawMessage) bool {
	return jsonString(a) == jsonString(b)
}

func jsonString(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprintf("%v", v)
	}
	return string(b)
}
