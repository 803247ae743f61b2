package batch

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// ManifestJob is a registered job as manifest_jobs holds it.
type ManifestJob struct {
	JobID      string             `json:"job_id"`
	Tenant     string             `json:"tenant"`
	Target     ManifestTarget     `json:"target"`
	Transition ManifestTransition `json:"transition"`
	Topic      string             `json:"topic"`
	IDType     string             `json:"id_type"`
	ChunkSize  int                `json:"chunk_size"`
	ItemCount  int                `json:"item_count"`
	NextIndex  int                `json:"next_index"`
	State      string             `json:"state"`
	ChunksDone int                `json:"chunks_done"`
	// Conflict says why the job is conflicted (nil otherwise).
	Conflict   *ManifestConflict `json:"conflict,omitempty"`
	CreatedAt  time.Time         `json:"created_at"`
	UpdatedAt  time.Time         `json:"updated_at"`
	FinishedAt *time.Time        `json:"finished_at,omitempty"`

	itemsHash, contentHash string
}

func scanManifestJob(row pgx.Row) (ManifestJob, error) {
	var j ManifestJob
	var spec []byte
	var conflict []byte
	err := row.Scan(&j.JobID, &j.Tenant, &spec, &j.ChunkSize, &j.ItemCount, &j.itemsHash, &j.contentHash,
		&j.NextIndex, &j.State, &conflict, &j.ChunksDone, &j.CreatedAt, &j.UpdatedAt, &j.FinishedAt)
	if err != nil {
		return j, err
	}
	var h manifestHeader
	if err := json.Unmarshal(spec, &h); err != nil {
		return j, fmt.Errorf("manifest job %s: stored spec: %w", j.JobID, err)
	}
	j.Target, j.Transition, j.Topic, j.IDType = h.Target, h.Transition, h.Topic, h.IDType
	if conflict != nil {
		j.Conflict = &ManifestConflict{}
		if err := json.Unmarshal(conflict, j.Conflict); err != nil {
			return j, fmt.Errorf("manifest job %s: stored conflict: %w", j.JobID, err)
		}
	}
	return j, nil
}

func loadManifestJob(ctx context.Context, q manifestQuerier, sql, jobID string) (ManifestJob, error) {
	j, err := scanManifestJob(q.QueryRow(ctx, sql, jobID))
	if errors.Is(err, pgx.ErrNoRows) {
		return j, fmt.Errorf("%w: %q", ErrManifestNotFound, jobID)
	}
	if err != nil {
		return j, fmt.Errorf("load manifest job %s: %w", jobID, err)
	}
	return j, nil
}

// ListManifestJobs returns every registered job, oldest first.
func ListManifestJobs(ctx context.Context, db ManifestDB) ([]ManifestJob, error) {
	rows, err := db.Query(ctx, manifestListJobsSQL)
	if err != nil {
		return nil, fmt.Errorf("list manifest jobs: %w", err)
	}
	defer rows.Close()
	var out []ManifestJob
	for rows.Next() {
		j, err := scanManifestJob(rows)
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

// GetManifestJob returns one job.
func GetManifestJob(ctx context.Context, db ManifestDB, jobID string) (ManifestJob, error) {
	return loadManifestJob(ctx, db, manifestSelectJobSQL, jobID)
}

// ManifestRegistration says what RegisterManifest did.
type ManifestRegistration struct {
	// Created is false when the same job was registered before (the call
	// was a no-op).
	Created bool        `json:"created"`
	Job     ManifestJob `json:"job"`
}

// ManifestRegistrationConflictError lists what differs between a file and
// the job registered under its id. It wraps ErrManifestRegistrationConflict.
type ManifestRegistrationConflictError struct {
	JobID       string
	Differences []string
}

func (e *ManifestRegistrationConflictError) Error() string {
	return fmt.Sprintf("manifest job %q is already registered with a different %s; nothing changed (register the new approval under a new job id)",
		e.JobID, strings.Join(e.Differences, ", "))
}

func (e *ManifestRegistrationConflictError) Unwrap() error { return ErrManifestRegistrationConflict }

// RegisterManifest freezes an approved list (normalized by ParseManifest).
// The same job id with the same content, in any item order, is the same job:
// nothing changes and Created is false. The same job id with another tenant,
// target, transition, topic, chunk size or items is a
// *ManifestRegistrationConflictError and nothing changes. The target table
// and columns must exist.
func RegisterManifest(ctx context.Context, db ManifestDB, spec ManifestSpec) (ManifestRegistration, error) {
	if spec.Topic == "" || spec.IDType == "" {
		return ManifestRegistration{}, fmt.Errorf("%w: register a spec returned by ParseManifest", ErrManifestInvalid)
	}
	if _, err := resolveManifestTarget(ctx, db, spec.Target); err != nil {
		return ManifestRegistration{}, fmt.Errorf("register manifest job %s: %w", spec.JobID, err)
	}
	itemsHash, contentHash := spec.hashes()
	header, err := json.Marshal(spec.header())
	if err != nil {
		return ManifestRegistration{}, err
	}
	n := len(spec.Items)
	seqs, ids, revs, fields := make([]int32, n), make([]string, n), make([]int64, n), make([]string, n)
	for i, it := range spec.Items {
		f, err := json.Marshal(it.Fields)
		if err != nil {
			return ManifestRegistration{}, fmt.Errorf("items[%d] (id %s): fields: %w", i, it.ID, err)
		}
		seqs[i], ids[i], revs[i], fields[i] = int32(i), it.ID, it.Revision, string(f)
	}

	var reg ManifestRegistration
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var got string
		err := tx.QueryRow(ctx, manifestInsertJobSQL, spec.JobID, spec.Tenant, header, spec.ChunkSize, n, itemsHash, contentHash).Scan(&got)
		switch {
		case err == nil:
			if _, err := tx.Exec(ctx, manifestInsertItemsSQL, spec.JobID, seqs, ids, revs, fields); err != nil {
				return fmt.Errorf("insert %d items: %w", n, err)
			}
			reg.Created = true
		case errors.Is(err, pgx.ErrNoRows):
			// Registered before (or by a concurrent call that committed
			// first: ON CONFLICT waited for it).
		default:
			return fmt.Errorf("insert job: %w", err)
		}
		reg.Job, err = loadManifestJob(ctx, tx, manifestSelectJobSQL, spec.JobID)
		if err != nil || reg.Created || reg.Job.contentHash == contentHash {
			return err
		}
		diffs, err := manifestDifferences(ctx, tx, reg.Job, spec, itemsHash)
		if err != nil {
			return err
		}
		return &ManifestRegistrationConflictError{JobID: spec.JobID, Differences: diffs}
	})
	if err != nil {
		var ce *ManifestRegistrationConflictError
		if errors.As(err, &ce) {
			return ManifestRegistration{}, err
		}
		return ManifestRegistration{}, fmt.Errorf("register manifest job %s: %w", spec.JobID, err)
	}
	return reg, nil
}

// manifestDifferences names what differs between the stored job and spec.
func manifestDifferences(ctx context.Context, q manifestQuerier, job ManifestJob, spec ManifestSpec, itemsHash string) ([]string, error) {
	var d []string
	if job.Tenant != spec.Tenant {
		d = append(d, fmt.Sprintf("tenant (registered %q, file %q)", job.Tenant, spec.Tenant))
	}
	if job.ChunkSize != spec.ChunkSize {
		d = append(d, fmt.Sprintf("chunk size (registered %d, file %d)", job.ChunkSize, spec.ChunkSize))
	}
	if a, b := manifestJSON(job.Target), manifestJSON(spec.Target); a != b {
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
		d = append(d, "items ("+manifestFirstItemDifference(ctx, q, job, spec)+")")
	}
	if len(d) == 0 {
		d = append(d, "content hash")
	}
	return d, nil
}

func manifestFirstItemDifference(ctx context.Context, q manifestQuerier, job ManifestJob, spec ManifestSpec) string {
	rows, err := q.Query(ctx, manifestSelectItemsSQL, job.JobID)
	if err != nil {
		return fmt.Sprintf("registered %d, file %d", job.ItemCount, len(spec.Items))
	}
	stored, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (ManifestItem, error) {
		var it ManifestItem
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
		case !manifestSameFields(a.Fields, b.Fields):
			return fmt.Sprintf("%s; id %s: registered fields %s, file %s", prefix, a.ID, manifestJSON(a.Fields), manifestJSON(b.Fields))
		}
	}
	return prefix
}

func manifestSameFields(a, b map[string]json.RawMessage) bool {
	return manifestJSON(a) == manifestJSON(b)
}

func manifestJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprintf("%v", v)
	}
	return string(b)
}
