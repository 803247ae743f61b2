package batch

// Manifest jobs (seed 003): finish an interrupted batch over a frozen,
// approved list.
//
// An operator registers a list of items (id, approved revision, expected
// field values) with a tenant, a target table, a transition (status from →
// to, revision + 1) and a chunk size. The list is sorted by id and frozen.
// [DrainManifest] then applies it chunk by chunk: it locks the job row FOR
// UPDATE, verifies the progress against the audit, takes the next chunk by
// next_index into the frozen list (never by re-querying the target), and in
// one transaction applies the conditional UPDATE, writes one audit row per
// item, enqueues one outbox event per changed row and advances next_index.
// An item that no longer matches rolls back its whole chunk and stops the job
// as conflicted; finished chunks stay. [ReportManifest] lists approved,
// committed and unprocessed ids and the current state of each committed one.
//
//	spec, err := batch.ParseManifest(file)
//	reg, err := batch.RegisterManifest(ctx, pool, spec)
//	res, err := batch.DrainManifest(ctx, pool, spec.JobID, batch.ManifestDrainOptions{MaxChunks: 2})
//	rep, err := batch.ReportManifest(ctx, pool, spec.JobID)

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
)

// ManifestDemoOrdersSQL creates the demo orders table (id bigint, tenant_id,
// revision, status, qty, updated_at) with a trigger that bumps revision on
// every other write. It is the user's table, not a migration. Idempotent.
//
//go:embed manifest_demo_orders.sql
var ManifestDemoOrdersSQL string

// ManifestDefaultTopic is the outbox topic of a manifest job whose file
// names none.
const ManifestDefaultTopic = "outboxrelay.orders"

// Manifest job states (manifest_jobs.state).
const (
	ManifestStatePending    = "pending"
	ManifestStateRunning    = "running"
	ManifestStateSucceeded  = "succeeded"
	ManifestStateConflicted = "conflicted"
)

// Errors of manifest jobs. Each is wrapped by a more specific error that
// says which job, item or setting.
var (
	// ErrManifestInvalid: the manifest file is malformed (the error names
	// the item or setting).
	ErrManifestInvalid = errors.New("invalid manifest")
	// ErrManifestRegistrationConflict: the job id is registered with other
	// content. Nothing changed.
	ErrManifestRegistrationConflict = errors.New("manifest job already registered with different content")
	// ErrManifestNotFound: no job with that id.
	ErrManifestNotFound = errors.New("manifest job not found")
	// ErrManifestConflicted: an approved item no longer matches the target
	// row; the job is conflicted and needs a new approval.
	ErrManifestConflicted = errors.New("manifest job conflicted")
	// ErrManifestProgressMismatch: next_index and the audit disagree with
	// the frozen list. Nothing was changed or repaired.
	ErrManifestProgressMismatch = errors.New("manifest progress does not match its audit")
)

// ManifestSpec is a manifest file: what was approved.
type ManifestSpec struct {
	// JobID names the job; registering it again with the same content is a
	// no-op. Required.
	JobID string `json:"job_id"`
	// Tenant every item must still belong to. Required.
	Tenant string `json:"tenant"`
	// Target is the user's table and its columns.
	Target ManifestTarget `json:"target"`
	// Transition is the approved change of status; revision always + 1.
	Transition ManifestTransition `json:"transition"`
	// ChunkSize is how many items commit together (the approval's unit of
	// partial completion). Required, > 0.
	ChunkSize int `json:"chunk_size"`
	// Topic of the outbox events (default outboxrelay.orders).
	Topic string `json:"topic,omitempty"`
	// IDType is "number" or "string": how the items' ids were written, and
	// so how they sort. Set by ParseManifest.
	IDType string `json:"id_type,omitempty"`
	// Items, sorted by id by ParseManifest.
	Items []ManifestItem `json:"items"`
}

// ManifestTarget names the table and columns a manifest job changes.
// Identifiers are quoted, never spliced raw.
type ManifestTarget struct {
	// Schema of the table ("" = search_path).
	Schema string `json:"schema,omitempty"`
	// Table is required.
	Table string `json:"table"`
	// IDColumn (default "id"), TenantColumn (default "tenant_id"),
	// RevisionColumn (default "revision", an integer column), StatusColumn
	// (default "status").
	IDColumn       string `json:"id_column,omitempty"`
	TenantColumn   string `json:"tenant_column,omitempty"`
	RevisionColumn string `json:"revision_column,omitempty"`
	StatusColumn   string `json:"status_column,omitempty"`
	// MatchFields are the columns whose approved values each item carries
	// and that must still be equal (compared as PostgreSQL's to_jsonb
	// renders them), e.g. ["qty"].
	MatchFields []string `json:"match_fields"`
}

// ManifestTransition is the approved change: status From → To.
type ManifestTransition struct {
	From string `json:"from"`
	To   string `json:"to"`
}

// ManifestItem is one approved item.
type ManifestItem struct {
	// ID as text (numbers in decimal).
	ID string `json:"id"`
	// Revision the approval saw.
	Revision int64 `json:"revision"`
	// Fields are the approved values of Target.MatchFields.
	Fields map[string]json.RawMessage `json:"fields"`
}

// ParseManifest reads a manifest file (JSON), checks it and normalizes it:
// defaults filled in, items sorted by id. A malformed file is refused with
// an error naming the item ("items[3] (id 15): revision: ...").
func ParseManifest(r io.Reader) (ManifestSpec, error) {
	var raw struct {
		JobID      string             `json:"job_id"`
		Tenant     string             `json:"tenant"`
		Target     ManifestTarget     `json:"target"`
		Transition ManifestTransition `json:"transition"`
		ChunkSize  int                `json:"chunk_size"`
		Topic      string             `json:"topic"`
		Items      []json.RawMessage  `json:"items"`
	}
	dec := json.NewDecoder(r)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&raw); err != nil {
		return ManifestSpec{}, fmt.Errorf("%w: %v", ErrManifestInvalid, err)
	}
	spec := ManifestSpec{
		JobID: raw.JobID, Tenant: raw.Tenant, Target: raw.Target, Transition: raw.Transition,
		ChunkSize: raw.ChunkSize, Topic: raw.Topic,
	}
	spec.Target.fillDefaults()
	if err := spec.validateHeader(); err != nil {
		return ManifestSpec{}, err
	}
	if len(raw.Items) == 0 {
		return ManifestSpec{}, fmt.Errorf("%w: items: the list is empty", ErrManifestInvalid)
	}
	firstAt := map[string]int{}
	var nums []int64
	for i, data := range raw.Items {
		it, isNum, n, err := parseManifestItem(data, spec.Target.MatchFields)
		label := fmt.Sprintf("items[%d]", i)
		if it.ID != "" {
			label += fmt.Sprintf(" (id %s)", it.ID)
		}
		if err != nil {
			return ManifestSpec{}, fmt.Errorf("%w: %s: %v", ErrManifestInvalid, label, err)
		}
		idType := "string"
		if isNum {
			idType = "number"
		}
		if spec.IDType == "" {
			spec.IDType = idType
		} else if spec.IDType != idType {
			return ManifestSpec{}, fmt.Errorf("%w: %s: id is a %s but items[0] has a %s id; write every id the same way", ErrManifestInvalid, label, idType, spec.IDType)
		}
		if prev, dup := firstAt[it.ID]; dup {
			return ManifestSpec{}, fmt.Errorf("%w: %s: duplicate id, also items[%d]", ErrManifestInvalid, label, prev)
		}
		firstAt[it.ID] = i
		spec.Items = append(spec.Items, it)
		nums = append(nums, n)
	}
	if spec.IDType == "number" {
		idx := make([]int, len(spec.Items))
		for i := range idx {
			idx[i] = i
		}
		slices.SortFunc(idx, func(a, b int) int { return cmp.Compare(nums[a], nums[b]) })
		sorted := make([]ManifestItem, len(idx))
		for i, j := range idx {
			sorted[i] = spec.Items[j]
		}
		spec.Items = sorted
	} else {
		slices.SortFunc(spec.Items, func(a, b ManifestItem) int { return strings.Compare(a.ID, b.ID) })
	}
	return spec, nil
}

func (t *ManifestTarget) fillDefaults() {
	t.IDColumn = cmp.Or(t.IDColumn, "id")
	t.TenantColumn = cmp.Or(t.TenantColumn, "tenant_id")
	t.RevisionColumn = cmp.Or(t.RevisionColumn, "revision")
	t.StatusColumn = cmp.Or(t.StatusColumn, "status")
	if t.MatchFields == nil {
		t.MatchFields = []string{}
	}
}

func (s *ManifestSpec) validateHeader() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrManifestInvalid, fmt.Sprintf(format, args...))
	}
	s.Topic = cmp.Or(s.Topic, ManifestDefaultTopic)
	switch {
	case strings.TrimSpace(s.JobID) == "":
		return bad("job_id is missing")
	case s.Tenant == "":
		return bad("tenant is missing")
	case s.Target.Table == "":
		return bad("target.table is missing")
	case s.Transition.From == "" || s.Transition.To == "":
		return bad("transition.from and transition.to are required (got %q → %q)", s.Transition.From, s.Transition.To)
	case s.Transition.From == s.Transition.To:
		return bad("transition.from and transition.to are both %q", s.Transition.From)
	case s.ChunkSize <= 0:
		return bad("chunk_size=%d: must be > 0", s.ChunkSize)
	}
	fixed := map[string]string{
		s.Target.IDColumn: "id_column", s.Target.TenantColumn: "tenant_column",
		s.Target.RevisionColumn: "revision_column", s.Target.StatusColumn: "status_column",
	}
	if len(fixed) != 4 {
		return bad("target: id, tenant, revision and status columns must be four different columns")
	}
	seen := map[string]bool{}
	for _, f := range s.Target.MatchFields {
		switch {
		case f == "":
			return bad("target.match_fields: empty column name")
		case fixed[f] != "":
			return bad("target.match_fields: %q is the %s; the transition changes or keys it", f, fixed[f])
		case seen[f]:
			return bad("target.match_fields: %q listed twice", f)
		}
		seen[f] = true
	}
	return nil
}

// parseManifestItem checks one item. It returns the item, whether its id was
// a JSON number and that number.
func parseManifestItem(data json.RawMessage, fields []string) (ManifestItem, bool, int64, error) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(data, &obj); err != nil || obj == nil {
		return ManifestItem{}, false, 0, fmt.Errorf("not an object: %s", manifestTruncate(string(data), 60))
	}
	var it ManifestItem
	var isNum bool
	var n int64
	rawID, ok := obj["id"]
	if !ok {
		return it, false, 0, errors.New(`"id" is missing`)
	}
	var id any
	d := json.NewDecoder(bytes.NewReader(rawID))
	d.UseNumber()
	if err := d.Decode(&id); err != nil {
		return it, false, 0, fmt.Errorf("id: %v", err)
	}
	switch v := id.(type) {
	case json.Number:
		x, err := strconv.ParseInt(v.String(), 10, 64)
		if err != nil {
			return it, false, 0, fmt.Errorf("id: %s is not an integer", v)
		}
		it.ID, isNum, n = strconv.FormatInt(x, 10), true, x
	case string:
		if v == "" {
			return it, false, 0, errors.New("id is empty")
		}
		it.ID = v
	default:
		return it, false, 0, fmt.Errorf("id: want a number or a string, got %s", manifestTruncate(string(rawID), 40))
	}
	rawRev, ok := obj["revision"]
	if !ok {
		return it, isNum, n, errors.New(`"revision" is missing`)
	}
	rev, err := strconv.ParseInt(string(bytes.TrimSpace(rawRev)), 10, 64)
	if err != nil || rev < 0 {
		return it, isNum, n, fmt.Errorf("revision: want an integer >= 0, got %s", manifestTruncate(string(rawRev), 40))
	}
	it.Revision = rev
	it.Fields = map[string]json.RawMessage{}
	if rawFields, ok := obj["fields"]; ok {
		var fm map[string]json.RawMessage
		if err := json.Unmarshal(rawFields, &fm); err != nil || (fm == nil && len(fields) > 0) {
			return it, isNum, n, fmt.Errorf("fields: want an object, got %s", manifestTruncate(string(rawFields), 40))
		}
		it.Fields = fm
		if it.Fields == nil {
			it.Fields = map[string]json.RawMessage{}
		}
	}
	for _, f := range fields {
		v, ok := it.Fields[f]
		if !ok {
			return it, isNum, n, fmt.Errorf("fields.%s is missing (target.match_fields lists it)", f)
		}
		var c bytes.Buffer
		if err := json.Compact(&c, v); err != nil {
			return it, isNum, n, fmt.Errorf("fields.%s: %v", f, err)
		}
		it.Fields[f] = c.Bytes()
	}
	for k := range it.Fields {
		if !slices.Contains(fields, k) {
			return it, isNum, n, fmt.Errorf("fields.%s is not in target.match_fields %v", k, fields)
		}
	}
	for k := range obj {
		if k != "id" && k != "revision" && k != "fields" {
			return it, isNum, n, fmt.Errorf("unknown key %q (want id, revision, fields)", k)
		}
	}
	return it, isNum, n, nil
}

func manifestTruncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// manifestHeader is everything of a spec but its items, as stored in
// manifest_jobs.spec.
type manifestHeader struct {
	Target     ManifestTarget     `json:"target"`
	Transition ManifestTransition `json:"transition"`
	Topic      string             `json:"topic"`
	IDType     string             `json:"id_type"`
}

func (s ManifestSpec) header() manifestHeader {
	return manifestHeader{Target: s.Target, Transition: s.Transition, Topic: s.Topic, IDType: s.IDType}
}

// hashes returns the sha256 of the normalized items and of the whole job.
// Items are sorted and fields marshal with sorted keys, so the order of the
// file does not matter.
func (s ManifestSpec) hashes() (items, content string) {
	hi := sha256.New()
	for _, it := range s.Items {
		f, _ := json.Marshal(it.Fields)
		fmt.Fprintf(hi, "%q\x1f%d\x1f%s\n", it.ID, it.Revision, f)
	}
	items = hex.EncodeToString(hi.Sum(nil))
	h, _ := json.Marshal(s.header())
	hc := sha256.New()
	fmt.Fprintf(hc, "%q\x1f%d\x1f%s\x1f%s", s.Tenant, s.ChunkSize, h, items)
	return items, hex.EncodeToString(hc.Sum(nil))
}
