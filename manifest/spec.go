package manifest

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

// DemoOrdersSQL creates the demo orders table (id bigint, tenant_id,
// revision, status, qty, updated_at) with a trigger that bumps revision on
// every other write. It is the user's table, not a migration. Idempotent.
//
//go:embed demo_orders.sql
var DemoOrdersSQL string

// DefaultTopic is the outbox topic of a manifest job whose file
// names none.
const DefaultTopic = "outboxrelay.orders"

// Manifest job states (manifest_jobs.state).
const (
	StatePending    = "pending"
	StateRunning    = "running"
	StateSucceeded  = "succeeded"
	StateConflicted = "conflicted"
)

// Errors of manifest jobs. Each is wrapped by a more specific error that
// says which job, item or setting.
var (
	// ErrInvalid: the manifest file is malformed (the error names
	// the item or setting).
	ErrInvalid = errors.New("invalid manifest")
	// ErrRegistrationConflict: the job id is registered with other
	// content. Nothing changed.
	ErrRegistrationConflict = errors.New("manifest job already registered with different content")
	// ErrNotFound: no job with that id.
	ErrNotFound = errors.New("manifest job not found")
	// ErrConflicted: an approved item no longer matches the target
	// row; the job is conflicted and needs a new approval.
	ErrConflicted = errors.New("manifest job conflicted")
	// ErrProgressMismatch: next_index and the audit disagree with
	// the frozen list. Nothing was changed or repaired.
	ErrProgressMismatch = errors.New("manifest progress does not match its audit")
)

// Spec is a manifest file: what was approved.
type Spec struct {
	// JobID names the job; registering it again with the same content is a
	// no-op. Required.
	JobID string `json:"job_id"`
	// Tenant every item must still belong to. Required.
	Tenant string `json:"tenant"`
	// Target is the user's table and its columns.
	Target Target `json:"target"`
	// Transition is the approved change of status; revision always + 1.
	Transition Transition `json:"transition"`
	// ChunkSize is how many items commit together (the approval's unit of
	// partial completion). Required, > 0.
	ChunkSize int `json:"chunk_size"`
	// Topic of the outbox events (default outboxrelay.orders).
	Topic string `json:"topic,omitempty"`
	// IDType is "number" or "string": how the items' ids were written, and
	// so how they sort. Set by Parse.
	IDType string `json:"id_type,omitempty"`
	// Items, sorted by id by Parse.
	Items []Item `json:"items"`
}

// Target names the table and columns a manifest job changes.
// Identifiers are quoted, never spliced raw.
type Target struct {
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
	// and that must still be equal, e.g. ["qty"]. Values are compared as
	// the column's type (the JSON value converted as jsonb_populate_record
	// does), so a timestamptz is the same instant whatever offset the file
	// or a session's TimeZone writes; a column type without equality is
	// refused at registration.
	MatchFields []string `json:"match_fields"`
}

// Transition is the approved change: status From → To.
type Transition struct {
	From string `json:"from"`
	To   string `json:"to"`
}

// Item is one approved item.
type Item struct {
	// ID as text (numbers in decimal).
	ID string `json:"id"`
	// Revision the approval saw.
	Revision int64 `json:"revision"`
	// Fields are the approved values of Target.MatchFields.
	Fields map[string]json.RawMessage `json:"fields"`
}

// Parse reads a manifest file (JSON), checks it and normalizes it:
// defaults filled in, items sorted by id. A malformed file is refused with
// an error naming the item ("items[3] (id 15): revision: ...").
func Parse(r io.Reader) (Spec, error) {
	var raw struct {
		JobID      string            `json:"job_id"`
		Tenant     string            `json:"tenant"`
		Target     Target            `json:"target"`
		Transition Transition        `json:"transition"`
		ChunkSize  int               `json:"chunk_size"`
		Topic      string            `json:"topic"`
		Items      []json.RawMessage `json:"items"`
	}
	dec := json.NewDecoder(r)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&raw); err != nil {
		return Spec{}, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	spec := Spec{
		JobID: raw.JobID, Tenant: raw.Tenant, Target: raw.Target, Transition: raw.Transition,
		ChunkSize: raw.ChunkSize, Topic: raw.Topic,
	}
	spec.Target.fillDefaults()
	if err := spec.validateHeader(); err != nil {
		return Spec{}, err
	}
	if len(raw.Items) == 0 {
		return Spec{}, fmt.Errorf("%w: items: the list is empty", ErrInvalid)
	}
	firstAt := map[string]int{}
	var nums []int64
	for i, data := range raw.Items {
		it, isNum, n, err := parseItem(data, spec.Target.MatchFields)
		label := fmt.Sprintf("items[%d]", i)
		if it.ID != "" {
			label += fmt.Sprintf(" (id %s)", it.ID)
		}
		if err != nil {
			return Spec{}, fmt.Errorf("%w: %s: %v", ErrInvalid, label, err)
		}
		idType := "string"
		if isNum {
			idType = "number"
		}
		if spec.IDType == "" {
			spec.IDType = idType
		} else if spec.IDType != idType {
			return Spec{}, fmt.Errorf("%w: %s: id is a %s but items[0] has a %s id; write every id the same way", ErrInvalid, label, idType, spec.IDType)
		}
		if prev, dup := firstAt[it.ID]; dup {
			return Spec{}, fmt.Errorf("%w: %s: duplicate id, also items[%d]", ErrInvalid, label, prev)
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
		sorted := make([]Item, len(idx))
		for i, j := range idx {
			sorted[i] = spec.Items[j]
		}
		spec.Items = sorted
	} else {
		slices.SortFunc(spec.Items, func(a, b Item) int { return strings.Compare(a.ID, b.ID) })
	}
	return spec, nil
}

func (t *Target) fillDefaults() {
	t.IDColumn = cmp.Or(t.IDColumn, "id")
	t.TenantColumn = cmp.Or(t.TenantColumn, "tenant_id")
	t.RevisionColumn = cmp.Or(t.RevisionColumn, "revision")
	t.StatusColumn = cmp.Or(t.StatusColumn, "status")
	if t.MatchFields == nil {
		t.MatchFields = []string{}
	}
}

func (s *Spec) validateHeader() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
	}
	s.Topic = cmp.Or(s.Topic, DefaultTopic)
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

// parseItem checks one item. It returns the item, whether its id was
// a JSON number and that number.
func parseItem(data json.RawMessage, fields []string) (Item, bool, int64, error) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(data, &obj); err != nil || obj == nil {
		return Item{}, false, 0, fmt.Errorf("not an object: %s", truncate(string(data), 60))
	}
	var it Item
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
		return it, false, 0, fmt.Errorf("id: want a number or a string, got %s", truncate(string(rawID), 40))
	}
	rawRev, ok := obj["revision"]
	if !ok {
		return it, isNum, n, errors.New(`"revision" is missing`)
	}
	rev, err := strconv.ParseInt(string(bytes.TrimSpace(rawRev)), 10, 64)
	if err != nil || rev < 0 {
		return it, isNum, n, fmt.Errorf("revision: want an integer >= 0, got %s", truncate(string(rawRev), 40))
	}
	it.Revision = rev
	it.Fields = map[string]json.RawMessage{}
	if rawFields, ok := obj["fields"]; ok {
		var fm map[string]json.RawMessage
		if err := json.Unmarshal(rawFields, &fm); err != nil || (fm == nil && len(fields) > 0) {
			return it, isNum, n, fmt.Errorf("fields: want an object, got %s", truncate(string(rawFields), 40))
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

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// storedHeader is everything of a spec but its items, as stored in
// manifest_jobs.spec.
type storedHeader struct {
	Target     Target     `json:"target"`
	Transition Transition `json:"transition"`
	Topic      string     `json:"topic"`
	IDType     string     `json:"id_type"`
}

func (s Spec) header() storedHeader {
	return storedHeader{Target: s.Target, Transition: s.Transition, Topic: s.Topic, IDType: s.IDType}
}

// hashes returns the sha256 of the normalized items and of the whole job.
// Items are sorted and fields marshal with sorted keys, so the order of the
// file does not matter.
func (s Spec) hashes() (items, content string) {
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
