package batch

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"gopkg.in/yaml.v3"
)

// Error policies for rows the processor cannot turn into a document.
const (
	// PolicyStrict fails the chunk and the run; the error names the row.
	PolicyStrict = "strict"
	// PolicyQuarantine records the row id and error in batch_quarantine (no
	// payload) and goes on.
	PolicyQuarantine = "quarantine"
	// PolicyRetry retries transient errors (bounded, exponential backoff with
	// jitter); a row that is malformed is not transient and fails the run.
	PolicyRetry = "retry"
)

// Run modes.
const (
	// ModeFull scans every row in scope from the beginning to the boundary.
	ModeFull = "full"
	// ModeIncremental orders by a change sequence column and starts where the
	// previous run of the same job and partition ended.
	ModeIncremental = "incremental"
)

// Spec describes a scan job. It is read from YAML or JSON ([LoadSpec]) or
// built in Go. Zero values take the defaults named on each field.
type Spec struct {
	// Job names the job; runs, metrics and quarantine rows carry it. Required.
	Job string `json:"job" yaml:"job"`
	// Mode is "full" (default) or "incremental".
	Mode string `json:"mode,omitempty" yaml:"mode,omitempty"`
	// Source says which table and columns to scan.
	Source Source `json:"source" yaml:"source"`
	// Document says how a row becomes the normalized document (built-in
	// normalizers, compiled to SQL). Ignored when the runner has a custom
	// Processor.
	Document Document `json:"document" yaml:"document"`
	// ProcessorVersion is stored with every run and normalized row and feeds
	// the event id. Changing it makes a stored run incompatible. Required.
	ProcessorVersion string `json:"processor_version" yaml:"processor_version"`
	// CompatibleVersions lists older processor versions whose runs may be
	// continued by this one with --resume.
	CompatibleVersions []string `json:"compatible_versions,omitempty" yaml:"compatible_versions,omitempty"`
	// Topic of the outbox events. Default "outboxrelay.records".
	Topic string `json:"topic,omitempty" yaml:"topic,omitempty"`
	// AggregateType of the outbox events. Default: the table name.
	AggregateType string `json:"aggregate_type,omitempty" yaml:"aggregate_type,omitempty"`
	// SourceName is normalized_records.source. Default: the table name.
	// Jobs that share one must send their events to one topic with one
	// aggregate type (a run is refused otherwise: the second job would
	// find every row unchanged and send nothing).
	SourceName string `json:"source_name,omitempty" yaml:"source_name,omitempty"`
	// Chunk tunes the chunk size.
	Chunk ChunkSettings `json:"chunk,omitempty" yaml:"chunk,omitempty"`
	// Errors is the bad-row policy.
	Errors ErrorPolicy `json:"errors,omitempty" yaml:"errors,omitempty"`
	// Vanished says what a full run does, once every partition succeeded,
	// with the live rows of normalized_records (this SourceName) whose
	// source row no longer exists or no longer matches the filter (or,
	// with an explicit source.partitions list, lies outside it): "delete"
	// (default for full runs) turns each into a tombstone and a delete
	// event, "keep" leaves them. An incremental job (default "keep") does
	// not see every row: with "delete" each of its runs first tombstones
	// the rows deleted (captured by the trigger [FollowTriggerSQL]
	// installs; a run is refused without it), truncated, or moved out of
	// scope since the last run, in the transaction that creates the run
	// (see deletes.go). See [VanishedDelete] for the tombstone's version.
	Vanished string `json:"vanished,omitempty" yaml:"vanished,omitempty"`
}

// What a full run does with rows that vanished from its scope
// (Spec.Vanished).
const (
	// VanishedDelete sweeps normalized_records after a full run, in
	// chunks, each one transaction with its checkpoint (batch_sweeps) and
	// fenced by a lease like a partition. A vanished row's tombstone
	// (deleted, no document) and its delete event carry the last normalized
	// source version + 1: the smallest version the index's external
	// versioning accepts over the last upsert, so a replay of any earlier
	// event cannot resurrect the row, and a row that comes back with any
	// later change (a version column that keeps growing, as the demo
	// trigger's) wins over the tombstone. A row that comes back with a
	// version at or below the tombstone's (re-inserted with the version
	// reset, restored from a backup) comes back too: the next run writes
	// it at the tombstone's version + 1 and keeps the difference as the
	// row's version_offset in normalized_records, so its later changes
	// (source version + offset) stay above (normalized_records.source_version
	// is the index's version; migration 011). The same holds for a
	// soft-deleted row whose source row is then hard-deleted, truncated or
	// moved out of scope: the sweep marks its tombstone vanished (no new
	// event, the index has it). The sweep treats every live row
	// of the job's SourceName as the job's: two jobs that write one source
	// name with different scopes (table, filter, partition list) need
	// distinct source names (or "keep" on both); a run refuses to start
	// (ErrSpec, naming the other job) when batch_jobs shows such a job.
	// A run that starts while normalized_records holds no row of the
	// SourceName (a first load) skips its sweep: every row it writes is one
	// its chunks saw, and a row the source loses after its chunk read it
	// is swept by the next full run (incremental runs never sweep; with
	// "delete" their next run tombstones it from the captured deletes).
	VanishedDelete = "delete"
	// VanishedKeep leaves vanished rows as they are.
	VanishedKeep = "keep"
)

// Source names the user's table and the roles of its columns. Identifiers
// are quoted, never spliced raw.
type Source struct {
	// Schema of the table. Default "public".
	Schema string `json:"schema,omitempty" yaml:"schema,omitempty"`
	// Table to scan. Required.
	Table string `json:"table" yaml:"table"`
	// Cursor lists the immutable order columns, the last one unique (e.g.
	// created_at, id). Default: [change_seq] in incremental mode, else [id].
	// A run refuses to start unless the columns are NOT NULL and the primary
	// key or a unique index has only these columns (and the partition
	// column): rows sharing a cursor value would be skipped.
	//
	// In incremental mode the first cursor column is the change column: a
	// run starts after the previous run's boundary, so a value must not
	// commit below a boundary once the writers open at that run's start have
	// ended (the run waits for them). A sequence without CACHE (CACHE 1),
	// set by nextval() in a DEFAULT, an identity or a trigger, meets that; a
	// sequence with CACHE > 1 does not (a run refuses to start on one it can
	// see: a DEFAULT's or an identity's), nor does a clock (now() is the
	// transaction's start, not its commit).
	Cursor []string `json:"cursor,omitempty" yaml:"cursor,omitempty"`
	// ID is the row's identity (aggregate id, Kafka key). Default "id".
	ID string `json:"id,omitempty" yaml:"id,omitempty"`
	// Version is the row's version column (bigint, grows on change).
	// Required.
	Version string `json:"version" yaml:"version"`
	// Deleted is the soft-delete column: a boolean, or any column where
	// non-NULL means deleted. Optional.
	Deleted string `json:"deleted,omitempty" yaml:"deleted,omitempty"`
	// Partition is the column whose values split the job into partitions
	// that run in parallel, each with its own cursor. Optional.
	Partition string `json:"partition,omitempty" yaml:"partition,omitempty"`
	// Partitions lists the partition values. Default: the distinct values
	// present when the run starts.
	Partitions []string `json:"partitions,omitempty" yaml:"partitions,omitempty"`
	// Filter restricts the scope; all conditions must hold.
	Filter []Condition `json:"filter,omitempty" yaml:"filter,omitempty"`
}

// Condition is one filter term: Column Op Value(s). Values are passed as
// parameters and cast to the column's type.
type Condition struct {
	// Column of the source table the term compares.
	Column string `json:"column" yaml:"column"`
	// Op is one of = != < <= > >= in "is null" "is not null".
	Op string `json:"op" yaml:"op"`
	// Value the column is compared with (it must cast to the column's
	// type); not with in and the null tests.
	Value string `json:"value,omitempty" yaml:"value,omitempty"`
	// Values of in.
	Values []string `json:"values,omitempty" yaml:"values,omitempty"`
}

// Document is the built-in normalizer: the fields of the document and how
// each is cleaned. It compiles to SQL expressions.
type Document struct {
	// Fields of the document, in order. Empty means the whole row as JSON.
	Fields []Field `json:"fields,omitempty" yaml:"fields,omitempty"`
	// DropNulls removes fields whose value is null.
	DropNulls bool `json:"drop_nulls,omitempty" yaml:"drop_nulls,omitempty"`
	// Relations add related rows to the document: a parent (many-to-one)
	// or one-to-one row as an object, children as an array, rows through a
	// join table, nested to any depth (see [Relation]). A document with
	// relations is rebuilt whenever a row in it changes: every full run
	// rebuilds every document; incremental and follow runs rebuild the
	// roots the capture triggers ([FollowTriggerSQL]) recorded. A rebuilt
	// document that differs from the stored one at the same root version
	// is written at the stored version + 1, so the index version of a
	// document only grows.
	Relations []Relation `json:"relations,omitempty" yaml:"relations,omitempty"`
}

// Relation types.
const (
	// OneToOne is a single related row (a parent through a many-to-one
	// key, or a one-to-one row): an object, or null when there is none.
	OneToOne = "one_to_one"
	// OneToMany is the related rows as an array ([] when none).
	OneToMany = "one_to_many"
)

// Relation variants: how a related row appears in its parent.
const (
	// VariantObject is an object of the relation's fields (default).
	VariantObject = "object"
	// VariantScalar is the value of the relation's only field.
	VariantScalar = "scalar"
	// VariantFlatten merges a one_to_one row's fields into the parent
	// object (null fields when there is no row).
	VariantFlatten = "flatten"
)

// Relation is a table joined into the document (PGSync users: a child of
// the schema, with its relationship). Its rows are joined to the parent
// object's row (the root row, or the row of the enclosing relation) on
// ForeignKey, or through a join table. Keys are single columns.
type Relation struct {
	// Name is the key of the relation in the parent object (unused with
	// variant flatten). Required.
	Name string `json:"name" yaml:"name"`
	// Schema of Table. Default: the source's schema.
	Schema string `json:"schema,omitempty" yaml:"schema,omitempty"`
	// Table is the related table. Required.
	Table string `json:"table" yaml:"table"`
	// Type is one_to_one (an object, or null) or one_to_many (an array).
	// Required.
	Type string `json:"type" yaml:"type"`
	// Variant is object (default), scalar or flatten (one_to_one only).
	Variant string `json:"variant,omitempty" yaml:"variant,omitempty"`
	// ForeignKey joins the parent's row and the related rows:
	// parent.<Parent> = child.<Child>. Through a join table, Parent is the
	// parent's column the join table refers to and Child the related
	// table's. Default: the single-column foreign key between the two
	// tables in the catalog (either direction); a start fails naming the
	// tables when there is none or more than one.
	ForeignKey *KeyPair `json:"foreign_key,omitempty" yaml:"foreign_key,omitempty"`
	// Through is the join table of a many-to-many relation.
	Through *Through `json:"through,omitempty" yaml:"through,omitempty"`
	// Deleted is the related table's soft-delete column (a boolean, or any
	// column where non-NULL means deleted): such rows are left out.
	Deleted string `json:"deleted,omitempty" yaml:"deleted,omitempty"`
	// OrderBy orders a one_to_many array (and picks a one_to_one row):
	// column names, each optionally followed by " desc". Default: the
	// related table's primary key, which also breaks ties.
	OrderBy []string `json:"order_by,omitempty" yaml:"order_by,omitempty"`
	// Limit bounds a one_to_many array. 0: no limit.
	Limit int `json:"limit,omitempty" yaml:"limit,omitempty"`
	// Fields of the related row, as a root field (from a column or a key
	// path, transforms, type, required). A related row that breaks a
	// check makes its root a bad row, with a message naming the relation
	// and the row. Required (scalar: exactly one).
	Fields []Field `json:"fields" yaml:"fields"`
	// Relations nest further tables inside each related row.
	Relations []Relation `json:"relations,omitempty" yaml:"relations,omitempty"`
}

// KeyPair names the joined columns of a relation.
type KeyPair struct {
	// Parent is the parent row's column (through a join table: the one the
	// join table refers to).
	Parent string `json:"parent" yaml:"parent"`
	// Child is the related table's column equal to it.
	Child string `json:"child" yaml:"child"`
}

// Through is a join table: Parent is its column that refers to the parent
// row, Child its column that refers to the related row.
type Through struct {
	// Schema of the join table. Default: the relation's schema.
	Schema string `json:"schema,omitempty" yaml:"schema,omitempty"`
	// Table is the join table. Required.
	Table string `json:"table" yaml:"table"`
	// Parent is the join table's column that refers to the parent row.
	// Default: the join table's single-column foreign key to the parent's
	// table.
	Parent string `json:"parent,omitempty" yaml:"parent,omitempty"`
	// Child is the join table's column that refers to the related row.
	// Default: its single-column foreign key to the related table.
	Child string `json:"child,omitempty" yaml:"child,omitempty"`
}

// Field is one document field.
type Field struct {
	// Name in the document. Required.
	Name string `json:"name" yaml:"name"`
	// From is a column ("title") or a key path inside a jsonb column
	// ("payload.title", "payload.author.name"). Default: Name.
	From string `json:"from,omitempty" yaml:"from,omitempty"`
	// Transforms applied to string values, in order: trim, lower, upper.
	Transforms []string `json:"transforms,omitempty" yaml:"transforms,omitempty"`
	// Type, when set, is the JSON type the value must have if present:
	// string, number, boolean, object or array. A mismatch is a bad row.
	Type string `json:"type,omitempty" yaml:"type,omitempty"`
	// Required makes a missing or null value a bad row.
	Required bool `json:"required,omitempty" yaml:"required,omitempty"`
}

// ChunkSettings tune the adaptive chunk size.
type ChunkSettings struct {
	// Size is the first chunk's size. Default 1000.
	Size int `json:"size,omitempty" yaml:"size,omitempty"`
	// Min and Max bound the size. Defaults 100 and 20000.
	Min int `json:"min,omitempty" yaml:"min,omitempty"`
	Max int `json:"max,omitempty" yaml:"max,omitempty"`
	// TargetDuration is the chunk duration the size adapts toward. Default
	// 1s. A fixed size: set Min = Max.
	TargetDuration Duration `json:"target_duration,omitempty" yaml:"target_duration,omitempty"`
	// LockTimeout bounds each lock wait inside a chunk; a timeout rolls the
	// chunk back, halves the size and retries. Default 5s.
	LockTimeout Duration `json:"lock_timeout,omitempty" yaml:"lock_timeout,omitempty"`
	// Concurrency is how many goroutines a custom Processor runs per chunk;
	// rows of one id stay in one goroutine, in order. Default 1.
	Concurrency int `json:"concurrency,omitempty" yaml:"concurrency,omitempty"`
	// Pipeline is how many chunks of one partition are in flight at once,
	// each in its own transaction on its own connection: chunk N+1 reads
	// and writes while chunk N commits. They still commit strictly in cursor
	// order (each checkpoint is conditioned on the previous chunk's end), so
	// a failure in chunk N rolls back N+1 too. A partition's last chunk,
	// when shorter than the chunk size (and at least twice chunk.min), is
	// split in two halves that run at once. 1 turns it off. Default 2;
	// lowered when the pool has too few connections for the workers
	// (each worker needs Pipeline, plus one for heartbeats).
	Pipeline int `json:"pipeline,omitempty" yaml:"pipeline,omitempty"`
}

// ErrorPolicy says what happens to bad rows and transient errors.
type ErrorPolicy struct {
	// Policy is strict (default), quarantine or retry.
	Policy string `json:"policy,omitempty" yaml:"policy,omitempty"`
	// MaxRetries bounds the retries of one chunk after transient errors
	// (lock timeouts, serialization failures, lost connections, and under
	// the retry policy rows a Processor marks [Transient]). Default 5;
	// -1 disables retries.
	MaxRetries int `json:"max_retries,omitempty" yaml:"max_retries,omitempty"`
	// InitialBackoff and MaxBackoff shape the exponential backoff (with
	// jitter). Defaults 100ms and 5s.
	InitialBackoff Duration `json:"initial_backoff,omitempty" yaml:"initial_backoff,omitempty"`
	MaxBackoff     Duration `json:"max_backoff,omitempty" yaml:"max_backoff,omitempty"`
	// PartitionAttempts bounds how many times a partition is attempted
	// when it fails (a chunk failed for good: its retries ran out, or its
	// error is not transient). After a failure the partition goes back to
	// pending and any worker retries it from its last checkpoint once
	// PartitionBackoff has passed, doubling per failure up to 10m; after
	// the last attempt it stays failed until an operator reruns the job
	// (which also ends a wait for an automatic retry at once). A
	// bad row under the strict policy and an exceeded skip limit fail at
	// once (they would fail the same way). Default 3; 1 turns automatic retries off.
	PartitionAttempts int `json:"partition_attempts,omitempty" yaml:"partition_attempts,omitempty"`
	// PartitionBackoff is the wait before the first automatic retry of a
	// failed partition. Default 10s.
	PartitionBackoff Duration `json:"partition_backoff,omitempty" yaml:"partition_backoff,omitempty"`
	// SkipLimit bounds how many rows one run may quarantine (open rows in
	// batch_quarantine; resolved ones do not count). The chunk that
	// crosses it rolls back and the run fails with [ErrSkipLimit], naming
	// the most frequent error code. 0 means no limit.
	SkipLimit int `json:"skip_limit,omitempty" yaml:"skip_limit,omitempty"`
	// SkipRatio bounds the quarantined share of the rows the run processed
	// so far (the crossing chunk included), e.g. 0.01, judged once the run
	// has processed SkipRatioMinRows rows. 0 means no limit.
	SkipRatio float64 `json:"skip_ratio,omitempty" yaml:"skip_ratio,omitempty"`
	// SkipRatioMinRows is the sample SkipRatio waits for: below it a share
	// says little (the run's first quarantined row is 1 of 1), so only
	// SkipLimit applies; the first chunk that reaches it is judged on every
	// row quarantined before it too. A run with fewer rows in all is never
	// judged by the ratio. Default 1000; 1 judges from the first row.
	SkipRatioMinRows int `json:"skip_ratio_min_rows,omitempty" yaml:"skip_ratio_min_rows,omitempty"`
}

// Duration is a time.Duration written as "1.5s" in specs.
type Duration time.Duration

// MarshalJSON writes "1.5s".
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

// UnmarshalJSON reads "1.5s" or a number of nanoseconds.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		var n int64
		if err2 := json.Unmarshal(b, &n); err2 != nil {
			return fmt.Errorf("duration: want a string such as \"1.5s\": %w", err)
		}
		*d = Duration(n)
		return nil
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// MarshalYAML writes "1.5s".
func (d Duration) MarshalYAML() (any, error) { return time.Duration(d).String(), nil }

// UnmarshalYAML reads "1.5s".
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	v, err := time.ParseDuration(n.Value)
	if err != nil {
		return fmt.Errorf("line %d: %w", n.Line, err)
	}
	*d = Duration(v)
	return nil
}

// LoadSpec reads a spec from a .json, .yaml or .yml file. Unknown keys are
// errors, so a typo does not silently fall back to a default.
func LoadSpec(path string) (Spec, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return Spec{}, fmt.Errorf("read spec: %w", err)
	}
	return ParseSpec(b, filepath.Ext(path))
}

// ParseSpec decodes a spec; ext is ".json", ".yaml" or ".yml" (JSON is
// also valid YAML, so "" is decoded as YAML).
func ParseSpec(b []byte, ext string) (Spec, error) {
	var s Spec
	if strings.EqualFold(ext, ".json") {
		dec := json.NewDecoder(strings.NewReader(string(b)))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&s); err != nil {
			return Spec{}, fmt.Errorf("parse spec: %w", err)
		}
	} else {
		dec := yaml.NewDecoder(strings.NewReader(string(b)))
		dec.KnownFields(true)
		if err := dec.Decode(&s); err != nil {
			return Spec{}, fmt.Errorf("parse spec: %w", err)
		}
	}
	s = s.withDefaults()
	if err := s.validate(); err != nil {
		return Spec{}, err
	}
	return s, nil
}

const (
	defaultTopic          = "outboxrelay.records"
	defaultChunkSize      = 1000
	defaultChunkMin       = 100
	defaultChunkMax       = 20000
	defaultTargetDuration = Duration(time.Second)
	defaultLockTimeout    = Duration(5 * time.Second)
	defaultPipeline       = 2
	defaultMaxRetries     = 5
	defaultInitialBackoff = Duration(100 * time.Millisecond)
	defaultMaxBackoff     = Duration(5 * time.Second)

	defaultPartitionAttempts = 3
	defaultPartitionBackoff  = Duration(10 * time.Second)
	defaultSkipRatioMinRows  = 1000
)

// withDefaults fills every default in one place.
func (s Spec) withDefaults() Spec {
	s.Mode = cmp.Or(s.Mode, ModeFull)
	s.Source.Schema = cmp.Or(s.Source.Schema, "public")
	s.Source.ID = cmp.Or(s.Source.ID, "id")
	if len(s.Source.Cursor) == 0 {
		if s.Mode == ModeIncremental {
			s.Source.Cursor = []string{"change_seq"}
		} else {
			s.Source.Cursor = []string{s.Source.ID}
		}
	}
	s.Topic = cmp.Or(s.Topic, defaultTopic)
	s.AggregateType = cmp.Or(s.AggregateType, s.Source.Table)
	s.SourceName = cmp.Or(s.SourceName, s.Source.Table)
	s.Chunk.Size = cmp.Or(s.Chunk.Size, defaultChunkSize)
	s.Chunk.Min = cmp.Or(s.Chunk.Min, min(defaultChunkMin, s.Chunk.Size))
	s.Chunk.Max = cmp.Or(s.Chunk.Max, max(defaultChunkMax, s.Chunk.Size))
	s.Chunk.TargetDuration = cmp.Or(s.Chunk.TargetDuration, defaultTargetDuration)
	s.Chunk.LockTimeout = cmp.Or(s.Chunk.LockTimeout, defaultLockTimeout)
	s.Chunk.Concurrency = cmp.Or(s.Chunk.Concurrency, 1)
	s.Chunk.Pipeline = cmp.Or(s.Chunk.Pipeline, defaultPipeline)
	s.Errors.Policy = cmp.Or(s.Errors.Policy, PolicyStrict)
	s.Errors.MaxRetries = cmp.Or(s.Errors.MaxRetries, defaultMaxRetries)
	if s.Errors.MaxRetries < 0 {
		s.Errors.MaxRetries = 0
	}
	s.Errors.InitialBackoff = cmp.Or(s.Errors.InitialBackoff, defaultInitialBackoff)
	s.Errors.MaxBackoff = cmp.Or(s.Errors.MaxBackoff, defaultMaxBackoff)
	s.Errors.PartitionAttempts = cmp.Or(s.Errors.PartitionAttempts, defaultPartitionAttempts)
	s.Errors.PartitionBackoff = cmp.Or(s.Errors.PartitionBackoff, defaultPartitionBackoff)
	s.Errors.SkipRatioMinRows = cmp.Or(s.Errors.SkipRatioMinRows, defaultSkipRatioMinRows)
	if s.Vanished == "" {
		s.Vanished = VanishedKeep
		if s.Mode == ModeFull {
			s.Vanished = VanishedDelete
		}
	}
	for i := range s.Document.Fields {
		s.Document.Fields[i].From = cmp.Or(s.Document.Fields[i].From, s.Document.Fields[i].Name)
	}
	s.Document.Relations = relationDefaults(s.Document.Relations, s.Source.Schema)
	return s
}

// relationDefaults fills the defaults of rels and their nested relations
// (in copies: a Spec's slices may be shared).
func relationDefaults(rels []Relation, schema string) []Relation {
	if rels == nil {
		return nil
	}
	out := slices.Clone(rels)
	for i := range out {
		r := &out[i]
		r.Schema = cmp.Or(r.Schema, schema)
		r.Variant = cmp.Or(r.Variant, VariantObject)
		if r.Through != nil {
			t := *r.Through
			t.Schema = cmp.Or(t.Schema, r.Schema)
			r.Through = &t
		}
		r.Fields = slices.Clone(r.Fields)
		for j := range r.Fields {
			r.Fields[j].From = cmp.Or(r.Fields[j].From, r.Fields[j].Name)
		}
		r.Relations = relationDefaults(r.Relations, r.Schema)
	}
	return out
}

// maxRelationDepth bounds how deep relations nest.
const maxRelationDepth = 4

// validateRelations checks what can be checked of rels without the
// database; at names the enclosing setting ("document.relations").
// names are the keys the parent object has already.
func validateRelations(job, at string, rels []Relation, names map[string]bool, depth int) error {
	if depth > maxRelationDepth {
		return fmt.Errorf("spec %s: %s: relations nest %d deep; at most %d", job, at, depth, maxRelationDepth)
	}
	for i, r := range rels {
		here := fmt.Sprintf("%s[%d]", at, i)
		if r.Name != "" {
			here = fmt.Sprintf("%s[%s]", at, r.Name)
		}
		switch {
		case r.Table == "":
			return fmt.Errorf("spec %s: %s.table is required", job, here)
		case r.Name == "" && r.Variant != VariantFlatten:
			return fmt.Errorf("spec %s: %s.name is required (the key of the relation in its parent object)", job, here)
		case r.Type != OneToOne && r.Type != OneToMany:
			return fmt.Errorf("spec %s: %s.type %q: want %s (an object or null) or %s (an array)", job, here, r.Type, OneToOne, OneToMany)
		case r.Variant != VariantObject && r.Variant != VariantScalar && r.Variant != VariantFlatten:
			return fmt.Errorf("spec %s: %s.variant %q: want object, scalar or flatten", job, here, r.Variant)
		case r.Variant == VariantFlatten && r.Type != OneToOne:
			return fmt.Errorf("spec %s: %s: variant flatten needs type %s (the fields of one row go into the parent object)", job, here, OneToOne)
		case r.Variant == VariantScalar && len(r.Fields) != 1:
			return fmt.Errorf("spec %s: %s: variant scalar needs exactly one field, has %d", job, here, len(r.Fields))
		case r.Variant == VariantScalar && len(r.Relations) > 0:
			return fmt.Errorf("spec %s: %s: variant scalar cannot nest relations (it has no object to put them in)", job, here)
		case len(r.Fields) == 0:
			return fmt.Errorf("spec %s: %s.fields: at least one field is required", job, here)
		case r.Limit < 0:
			return fmt.Errorf("spec %s: %s.limit %d: want >= 0 (0 = no limit)", job, here, r.Limit)
		case r.Limit > 0 && r.Type != OneToMany:
			return fmt.Errorf("spec %s: %s.limit: only a %s relation has a limit", job, here, OneToMany)
		case r.ForeignKey != nil && (r.ForeignKey.Parent == "" || r.ForeignKey.Child == ""):
			return fmt.Errorf("spec %s: %s.foreign_key needs both parent and child columns (parent.<parent> = child.<child>); leave it out to take the catalog's foreign key", job, here)
		case r.Through != nil && r.Through.Table == "":
			return fmt.Errorf("spec %s: %s.through.table is required", job, here)
		case r.Through != nil && (r.Through.Parent == "") != (r.Through.Child == ""):
			return fmt.Errorf("spec %s: %s.through needs both parent and child columns, or neither (the catalog's foreign keys)", job, here)
		}
		for _, o := range r.OrderBy {
			col, dir, _ := strings.Cut(strings.TrimSpace(o), " ")
			if col == "" || (dir != "" && !strings.EqualFold(strings.TrimSpace(dir), "asc") && !strings.EqualFold(strings.TrimSpace(dir), "desc")) {
				return fmt.Errorf("spec %s: %s.order_by %q: want a column, optionally followed by asc or desc", job, here, o)
			}
		}
		if r.Variant != VariantFlatten {
			if names[r.Name] {
				return fmt.Errorf("spec %s: %s: the key %q appears twice in its object", job, here, r.Name)
			}
			names[r.Name] = true
		}
		own := map[string]bool{}
		for j, f := range r.Fields {
			if err := validateField(job, fmt.Sprintf("%s.fields[%d]", here, j), f); err != nil {
				return err
			}
			if own[f.Name] {
				return fmt.Errorf("spec %s: %s.fields[%d].name %q appears twice", job, here, j, f.Name)
			}
			own[f.Name] = true
			if r.Variant == VariantFlatten {
				if names[f.Name] {
					return fmt.Errorf("spec %s: %s.fields[%d]: flattened key %q is already in the parent object", job, here, j, f.Name)
				}
				names[f.Name] = true
			}
		}
		inner := own
		if r.Variant == VariantFlatten {
			inner = names
		}
		if err := validateRelations(job, here+".relations", r.Relations, inner, depth+1); err != nil {
			return err
		}
	}
	return nil
}

// validateField checks one field of the document or of a relation.
func validateField(job, at string, f Field) error {
	if f.Name == "" {
		return fmt.Errorf("spec %s: %s.name is required", job, at)
	}
	for _, t := range f.Transforms {
		if !slices.Contains([]string{"trim", "lower", "upper"}, t) {
			return fmt.Errorf("spec %s: %s (%s): transform %q: want trim, lower or upper", job, at, f.Name, t)
		}
	}
	if f.Type != "" && !slices.Contains([]string{"string", "number", "boolean", "object", "array"}, f.Type) {
		return fmt.Errorf("spec %s: %s (%s): type %q: want string, number, boolean, object or array", job, at, f.Name, f.Type)
	}
	return nil
}

// HasRelations reports whether documents join related tables.
func (d Document) HasRelations() bool { return len(d.Relations) > 0 }

// validate checks what can be checked without the database; errors name
// the setting and the bad value. [Compile] checks the table and columns.
func (s Spec) validate() error {
	switch {
	case s.Job == "":
		return fmt.Errorf("spec: job is required")
	case s.Source.Table == "":
		return fmt.Errorf("spec %s: source.table is required", s.Job)
	case s.Source.Version == "":
		return fmt.Errorf("spec %s: source.version is required (the column whose value grows on every change)", s.Job)
	case s.ProcessorVersion == "":
		return fmt.Errorf("spec %s: processor_version is required", s.Job)
	case s.Mode != ModeFull && s.Mode != ModeIncremental:
		return fmt.Errorf("spec %s: mode %q: want full or incremental", s.Job, s.Mode)
	case s.Chunk.Size <= 0 || s.Chunk.Min <= 0 || s.Chunk.Min > s.Chunk.Max:
		return fmt.Errorf("spec %s: chunk size %d, min %d, max %d: want 0 < min <= max", s.Job, s.Chunk.Size, s.Chunk.Min, s.Chunk.Max)
	case s.Chunk.TargetDuration <= 0:
		return fmt.Errorf("spec %s: chunk.target_duration %s must be > 0", s.Job, time.Duration(s.Chunk.TargetDuration))
	case s.Chunk.Pipeline < 1 || s.Chunk.Pipeline > 4:
		return fmt.Errorf("spec %s: chunk.pipeline %d: want 1..4", s.Job, s.Chunk.Pipeline)
	case s.Chunk.Concurrency < 1 || s.Chunk.Concurrency > 256:
		return fmt.Errorf("spec %s: chunk.concurrency %d: want 1..256", s.Job, s.Chunk.Concurrency)
	}
	switch {
	case s.Errors.PartitionAttempts < 1:
		return fmt.Errorf("spec %s: errors.partition_attempts %d: want >= 1 (1 = no automatic retry)", s.Job, s.Errors.PartitionAttempts)
	case s.Errors.SkipLimit < 0:
		return fmt.Errorf("spec %s: errors.skip_limit %d: want >= 0 (0 = no limit)", s.Job, s.Errors.SkipLimit)
	case s.Errors.SkipRatioMinRows < 0:
		return fmt.Errorf("spec %s: errors.skip_ratio_min_rows %d: want >= 0 (0 = the default, %d)", s.Job, s.Errors.SkipRatioMinRows, defaultSkipRatioMinRows)
	case s.Errors.SkipRatio < 0 || s.Errors.SkipRatio > 1:
		return fmt.Errorf("spec %s: errors.skip_ratio %g: want 0..1 (0 = no limit)", s.Job, s.Errors.SkipRatio)
	case s.Errors.PartitionBackoff < 0:
		return fmt.Errorf("spec %s: errors.partition_backoff %s: want >= 0", s.Job, time.Duration(s.Errors.PartitionBackoff))
	case s.Vanished != VanishedDelete && s.Vanished != VanishedKeep:
		return fmt.Errorf("spec %s: vanished %q: want delete or keep", s.Job, s.Vanished)
	}
	switch s.Errors.Policy {
	case PolicyStrict, PolicyQuarantine, PolicyRetry:
	default:
		return fmt.Errorf("spec %s: errors.policy %q: want strict, quarantine or retry", s.Job, s.Errors.Policy)
	}
	for i, c := range s.Source.Filter {
		if _, ok := filterOps[strings.ToLower(c.Op)]; !ok {
			return fmt.Errorf("spec %s: source.filter[%d].op %q: want one of = != < <= > >= in \"is null\" \"is not null\"", s.Job, i, c.Op)
		}
		if c.Column == "" {
			return fmt.Errorf("spec %s: source.filter[%d].column is required", s.Job, i)
		}
	}
	seen := map[string]bool{}
	for i, f := range s.Document.Fields {
		if f.Name == "" {
			return fmt.Errorf("spec %s: document.fields[%d].name is required", s.Job, i)
		}
		if seen[f.Name] {
			return fmt.Errorf("spec %s: document.fields[%d].name %q appears twice", s.Job, i, f.Name)
		}
		seen[f.Name] = true
		for _, t := range f.Transforms {
			if !slices.Contains([]string{"trim", "lower", "upper"}, t) {
				return fmt.Errorf("spec %s: document.fields[%d] (%s): transform %q: want trim, lower or upper", s.Job, i, f.Name, t)
			}
		}
		if f.Type != "" && !slices.Contains([]string{"string", "number", "boolean", "object", "array"}, f.Type) {
			return fmt.Errorf("spec %s: document.fields[%d] (%s): type %q: want string, number, boolean, object or array", s.Job, i, f.Name, f.Type)
		}
	}
	if len(s.Document.Fields) > 50 {
		return fmt.Errorf("spec %s: document has %d fields; at most 50", s.Job, len(s.Document.Fields))
	}
	return validateRelations(s.Job, "document.relations", s.Document.Relations, seen, 1)
}

var filterOps = map[string]string{
	"=": "=", "!=": "<>", "<>": "<>", "<": "<", "<=": "<=", ">": ">", ">=": ">=",
	"in": "in", "is null": "is null", "is not null": "is not null",
}

// Scope is what a run covers; it is stored with the run and its hash
// compared on every resume, so a changed filter cannot reuse a checkpoint.
type Scope struct {
	Schema    string      `json:"schema"`
	Table     string      `json:"table"`
	Mode      string      `json:"mode"`
	Cursor    []string    `json:"cursor"`
	ID        string      `json:"id"`
	Version   string      `json:"version"`
	Deleted   string      `json:"deleted,omitempty"`
	Partition string      `json:"partition,omitempty"`
	Filter    []Condition `json:"filter,omitempty"`
}

// Scope returns the normalized scope of the spec.
func (s Spec) Scope() Scope {
	f := slices.Clone(s.Source.Filter)
	for i := range f {
		f[i].Op = strings.ToLower(f[i].Op)
	}
	// Order of filter terms does not change the scope.
	slices.SortFunc(f, func(a, b Condition) int {
		return cmp.Or(cmp.Compare(a.Column, b.Column), cmp.Compare(a.Op, b.Op), cmp.Compare(a.Value, b.Value))
	})
	return Scope{Schema: s.Source.Schema, Table: s.Source.Table, Mode: s.Mode, Cursor: s.Source.Cursor, ID: s.Source.ID,
		Version: s.Source.Version, Deleted: s.Source.Deleted, Partition: s.Source.Partition, Filter: f}
}

// JSON returns the scope as canonical JSON.
func (sc Scope) JSON() []byte {
	b, _ := json.Marshal(sc)
	return b
}

// Hash is the hex SHA-256 of the canonical JSON.
func (sc Scope) Hash() string {
	sum := sha256.Sum256(sc.JSON())
	return hex.EncodeToString(sum[:])
}

// Hash is the hex SHA-256 of the document section in canonical form
// (defaults filled, fields ordered by name: field order does not change a
// JSON object). It is part of a job's run identity beside the processor
// version: the same processor version must mean the same documents.
func (d Document) Hash() string {
	f := slices.Clone(d.Fields)
	slices.SortFunc(f, func(a, b Field) int { return cmp.Compare(a.Name, b.Name) })
	b, _ := json.Marshal(Document{Fields: f, DropNulls: d.DropNulls, Relations: d.Relations})
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// DocumentChanges names what differs between two document sections, one
// entry per setting: "document.fields[title].transforms [trim] -> [trim
// upper]", "document.fields[kind] added", "document.drop_nulls true ->
// false". Nothing when they are equal.
func DocumentChanges(old, new Document) []string {
	var out []string
	byName := func(d Document) map[string]Field {
		m := make(map[string]Field, len(d.Fields))
		for _, f := range d.Fields {
			f.From = cmp.Or(f.From, f.Name)
			m[f.Name] = f
		}
		return m
	}
	was, now := byName(old), byName(new)
	names := make([]string, 0, len(was)+len(now))
	for n := range was {
		names = append(names, n)
	}
	for n := range now {
		if _, ok := was[n]; !ok {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	for _, n := range names {
		a, inOld := was[n]
		b, inNew := now[n]
		at := "document.fields[" + n + "]"
		switch {
		case !inOld:
			out = append(out, at+" added")
		case !inNew:
			out = append(out, at+" removed")
		default:
			if a.From != b.From {
				out = append(out, fmt.Sprintf("%s.from %s -> %s", at, a.From, b.From))
			}
			if !slices.Equal(a.Transforms, b.Transforms) {
				out = append(out, fmt.Sprintf("%s.transforms %v -> %v", at, a.Transforms, b.Transforms))
			}
			if a.Type != b.Type {
				out = append(out, fmt.Sprintf("%s.type %q -> %q", at, a.Type, b.Type))
			}
			if a.Required != b.Required {
				out = append(out, fmt.Sprintf("%s.required %v -> %v", at, a.Required, b.Required))
			}
		}
	}
	if old.DropNulls != new.DropNulls {
		out = append(out, fmt.Sprintf("document.drop_nulls %v -> %v", old.DropNulls, new.DropNulls))
	}
	was2, _ := json.Marshal(relationDefaults(old.Relations, ""))
	now2, _ := json.Marshal(relationDefaults(new.Relations, ""))
	if string(was2) != string(now2) {
		out = append(out, fmt.Sprintf("document.relations %s -> %s", was2, now2))
	}
	return out
}
