package index

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"

	"github.com/outboxrelay/outboxrelay/internal/pgconn"
)

// The job-aware read alias. Several jobs may write one alias (articles and
// notes into "content"), each with its own processor version, so each job
// is cut over and rolled back on its own. A job's documents are told apart
// by FieldAggregateType (header ce_aggregatetype, which the batcher sets to
// the job's aggregate type), and the read alias is a set of (generation,
// filter) entries in which every aggregate type is live in exactly one
// generation:
//
//   - the base generation, the one the write alias points at (where
//     events without a processor version go), shows every document except
//     tombstones and those of the aggregate types live elsewhere
//     ("must_not": terms on FieldAggregateType);
//   - every other generation in the alias shows only the aggregate types
//     live there ("filter": terms).
//
// So moving one job's type is one _aliases call that rewrites the filters
// of the generations involved: searches see its documents in the new
// generation and every other job's where they were, never both or neither.
// When a move leaves every job of the alias live in the target, the target
// becomes the base: the write alias moves too, and the generation left no
// longer belongs to the read alias (with one job per alias this is the
// whole-alias move of before). The state is the alias itself (read back by
// [ReadAliasState]); nothing else has to agree with it.

// AliasState is where the read alias of one alias points, per generation.
type AliasState struct {
	Alias, WriteAlias string
	// Base is the generation the write alias points at ("" when none).
	Base string
	// Read lists the generations the read alias points at; Types the
	// aggregate types each non-base entry shows (nil: no type filter, the
	// whole generation); Excluded the types the base entry hides.
	Read     []string
	Types    map[string][]string
	Excluded []string
}

// LiveOf returns the generation where typ's documents are found: the
// entry that shows it, else the base when it does not hide it.
func (s AliasState) LiveOf(typ string) string {
	for _, idx := range s.Read {
		if idx != s.Base && s.Types[idx] != nil && slices.Contains(s.Types[idx], typ) {
			return idx
		}
	}
	if s.Base != "" && slices.Contains(s.Read, s.Base) && !slices.Contains(s.Excluded, typ) {
		return s.Base
	}
	for _, idx := range s.Read {
		if idx != s.Base && s.Types[idx] == nil {
			return idx // an entry without a type filter (a read alias set by hand)
		}
	}
	return ""
}

// ReadAliasState reads alias's read alias entries and its write alias.
func ReadAliasState(ctx context.Context, client *elastic.Client, alias, writeAlias string) (AliasState, error) {
	s := AliasState{Alias: alias, WriteAlias: writeAlias, Types: map[string][]string{}}
	write, err := AliasTargets(ctx, client, writeAlias)
	if err != nil {
		return s, err
	}
	if len(write) > 1 {
		return s, fmt.Errorf("write alias %s points at %d indices %v; want one", writeAlias, len(write), write)
	}
	if len(write) == 1 {
		s.Base = write[0]
	}
	res, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method:       http.MethodGet,
		Path:         "/_alias/" + url.PathEscape(alias),
		IgnoreErrors: []int{http.StatusNotFound},
	})
	if err != nil {
		return s, fmt.Errorf("get alias %s: %w", alias, err)
	}
	if res.StatusCode == http.StatusNotFound {
		return s, nil
	}
	var body map[string]struct {
		Aliases map[string]struct {
			Filter json.RawMessage `json:"filter"`
		} `json:"aliases"`
	}
	if err := json.Unmarshal(res.Body, &body); err != nil {
		return s, fmt.Errorf("decode alias %s: %w", alias, err)
	}
	for idx, a := range body {
		e, ok := a.Aliases[alias]
		if !ok {
			continue
		}
		s.Read = append(s.Read, idx)
		shown, hidden := parseTypeFilter(e.Filter)
		if idx == s.Base {
			s.Excluded = hidden
		} else {
			s.Types[idx] = shown
		}
	}
	slices.Sort(s.Read)
	return s, nil
}

// parseTypeFilter reads the aggregate types an alias filter of this
// package shows (bool.filter terms) and hides (bool.must_not terms).
func parseTypeFilter(raw json.RawMessage) (shown, hidden []string) {
	var f struct {
		Bool struct {
			Filter  json.RawMessage `json:"filter"`
			MustNot json.RawMessage `json:"must_not"`
		} `json:"bool"`
	}
	if len(raw) == 0 || json.Unmarshal(raw, &f) != nil {
		return nil, nil
	}
	terms := func(raw json.RawMessage) []string {
		var clauses []map[string]map[string]json.RawMessage
		if len(raw) == 0 || json.Unmarshal(raw, &clauses) != nil {
			var one map[string]map[string]json.RawMessage // a single clause, not an array
			if json.Unmarshal(raw, &one) != nil {
				return nil
			}
			clauses = []map[string]map[string]json.RawMessage{one}
		}
		var out []string
		for _, c := range clauses {
			for field, v := range c["terms"] {
				if field != FieldAggregateType && field != FieldAggregateType+".keyword" {
					continue
				}
				var types []string
				if json.Unmarshal(v, &types) == nil {
					out = append(out, types...)
				}
			}
		}
		return out
	}
	return terms(f.Bool.Filter), terms(f.Bool.MustNot)
}

// typeFilter is the read alias filter of an entry: tombstones out, and
// only the types shown (shown != nil) or all but those hidden.
func typeFilter(field string, shown, hidden []string) map[string]any {
	mustNot := []any{map[string]any{"term": map[string]any{FieldDeleted: true}}}
	if len(hidden) > 0 {
		mustNot = append(mustNot, map[string]any{"terms": map[string]any{field: hidden}})
	}
	b := map[string]any{"must_not": mustNot}
	if shown != nil {
		b["filter"] = []any{map[string]any{"terms": map[string]any{field: shown}}}
	}
	return map[string]any{"bool": b}
}

// AggregateTypeField returns the field that matches aggregate types exactly
// in index: FieldAggregateType when mapped as a keyword (the built-in
// mapping), its ".keyword" sub-field when dynamic mapping made it text.
func AggregateTypeField(ctx context.Context, client *elastic.Client, index string) (string, error) {
	res, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method:       http.MethodGet,
		Path:         "/" + url.PathEscape(index) + "/_mapping/field/" + FieldAggregateType + "," + FieldAggregateType + ".keyword",
		IgnoreErrors: []int{http.StatusNotFound},
	})
	if err != nil {
		return "", fmt.Errorf("read the mapping of %s in %s: %w", FieldAggregateType, index, err)
	}
	if res.StatusCode == http.StatusNotFound {
		return FieldAggregateType, nil
	}
	var body map[string]struct {
		Mappings map[string]struct {
			Mapping map[string]struct {
				Type string `json:"type"`
			} `json:"mapping"`
		} `json:"mappings"`
	}
	if err := json.Unmarshal(res.Body, &body); err != nil {
		return "", fmt.Errorf("read the mapping of %s in %s: %w", FieldAggregateType, index, err)
	}
	for _, idx := range body {
		if f, ok := idx.Mappings[FieldAggregateType]; ok && f.Mapping[FieldAggregateType].Type == "keyword" {
			return FieldAggregateType, nil
		}
		if _, ok := idx.Mappings[FieldAggregateType+".keyword"]; ok {
			return FieldAggregateType + ".keyword", nil
		}
	}
	return FieldAggregateType, nil
}

// JobMove is a move of one job's documents (cutover, rollback) to a
// generation.
type JobMove struct {
	// Type is the job's aggregate type. "" (documents that cannot be told
	// apart) moves the whole alias, which is refused while other jobs write
	// it.
	Type string
	// Target is the generation index the job's documents go live in.
	Target string
	// JobTypes are the aggregate types of every job that writes the alias
	// (Type among them); none means Type's job is the only one.
	JobTypes []string
	// HealthTimeout bounds the wait for Target's health (see
	// [WaitHealthy]); 0 means DefaultHealthTimeout.
	HealthTimeout time.Duration
}

// DefaultHealthTimeout is how long a move waits for the target
// generation's shards.
const DefaultHealthTimeout = 2 * time.Minute

// MovePlan is what [PlanMove] found and [ApplyMove] does.
type MovePlan struct {
	Move   JobMove
	Before AliasState
	// From is the generation the job's documents are live in now ("" none).
	From string
	// Whole: the target becomes the base (the write alias moves to it);
	// OldBase then leaves the read alias.
	Whole   bool
	OldBase string
	// Leaving is the index whose documents searches stop finding through
	// this move, and LeavingQuery selects them (tombstones aside): all of
	// OldBase's visible documents for a whole move, else the job's type in
	// From. "" when nothing leaves.
	Leaving      string
	LeavingQuery elastic.Query
	// Noop: the job's documents are live in the target already.
	Noop    bool
	actions []any
}

// PlanMove computes the one _aliases call that moves m.Type to m.Target.
func PlanMove(ctx context.Context, client *elastic.Client, alias, writeAlias string, m JobMove) (MovePlan, error) {
	p := MovePlan{Move: m}
	s, err := ReadAliasState(ctx, client, alias, writeAlias)
	if err != nil {
		return p, err
	}
	p.Before, p.OldBase = s, s.Base
	others := slices.DeleteFunc(slices.Clone(m.JobTypes), func(t string) bool { return t == m.Type })
	slices.Sort(others)
	others = slices.Compact(others)
	if m.Type == "" {
		if len(others) > 0 {
			return p, fmt.Errorf("%w: the job's documents carry no aggregate type, so a move of them alone cannot be told from the other jobs' of alias %s (%s)",
				ErrUnsafeMove, alias, strings.Join(others, ", "))
		}
		p.From = s.Base
		if len(s.Read) == 1 {
			p.From = s.Read[0]
		}
	} else {
		p.From = s.LiveOf(m.Type)
	}
	// The state after the move: the types each generation shows.
	shown := map[string][]string{} // non-base entries
	for idx, types := range s.Types {
		if types != nil {
			shown[idx] = slices.Clone(types)
		}
	}
	excluded := slices.Clone(s.Excluded)
	if m.Type != "" {
		for idx := range shown {
			shown[idx] = slices.DeleteFunc(shown[idx], func(t string) bool { return t == m.Type })
		}
		excluded = slices.DeleteFunc(excluded, func(t string) bool { return t == m.Type })
		if m.Target != s.Base {
			shown[m.Target] = append(shown[m.Target], m.Type)
			excluded = append(excluded, m.Type)
		}
	}
	liveAfter := func(t string) string {
		for idx, types := range shown {
			if slices.Contains(types, t) {
				return idx
			}
		}
		if s.Base != "" && !slices.Contains(excluded, t) {
			return s.Base
		}
		return ""
	}
	p.Whole = m.Target != s.Base
	for _, t := range others {
		if liveAfter(t) != m.Target {
			p.Whole = false
		}
	}
	// A read alias entry without a type filter on another generation than
	// the base (set by hand, or a state this package never makes) cannot
	// be kept apart: only a whole move replaces it.
	for _, idx := range s.Read {
		if idx != s.Base && s.Types[idx] == nil && idx != m.Target && !p.Whole {
			return p, fmt.Errorf("%w: read alias %s points at %s without an aggregate type filter; a move of one job would show its documents twice", ErrUnsafeMove, alias, idx)
		}
	}
	if p.From == m.Target && !p.Whole {
		p.Noop = true
		return p, nil
	}
	fields := map[string]string{}
	field := func(idx string) (string, error) {
		if f, ok := fields[idx]; ok {
			return f, nil
		}
		f, err := AggregateTypeField(ctx, client, idx)
		fields[idx] = f
		return f, err
	}
	var actions []any
	remove := func(idx, a string) {
		actions = append(actions, map[string]any{"remove": map[string]any{"index": idx, "alias": a}})
	}
	add := func(idx string, filter map[string]any) {
		actions = append(actions, map[string]any{"add": map[string]any{"index": idx, "alias": alias, "filter": filter}})
	}
	if p.Whole {
		// The target becomes the base; every other entry keeps what it
		// shows, and the old base leaves the read alias.
		p.Leaving = s.Base
		if s.Base == "" && len(s.Read) == 1 {
			p.Leaving = s.Read[0]
		}
		delete(shown, m.Target)
		var hide []string
		for idx, types := range shown {
			if idx != s.Base {
				hide = append(hide, types...)
			}
		}
		slices.Sort(hide)
		f, err := field(m.Target)
		if err != nil {
			return p, err
		}
		for _, idx := range s.Read {
			if idx != m.Target && (idx == s.Base || len(shown[idx]) == 0) {
				remove(idx, alias)
			}
		}
		if s.Base != "" {
			remove(s.Base, writeAlias)
		}
		for idx, types := range shown {
			if idx == s.Base || len(types) == 0 {
				continue
			}
			fi, err := field(idx)
			if err != nil {
				return p, err
			}
			add(idx, typeFilter(fi, types, nil))
		}
		if len(hide) == 0 {
			add(m.Target, notDeletedFilter)
		} else {
			add(m.Target, typeFilter(f, nil, hide))
		}
		actions = append(actions, map[string]any{"add": map[string]any{"index": m.Target, "alias": writeAlias, "is_write_index": true}})
	} else {
		if p.From != "" && p.From != m.Target {
			p.Leaving = p.From
		}
		// Rewrite the entries of the base, the generation the type leaves
		// and the target; drop entries left showing nothing.
		touched := []string{m.Target}
		if p.From != "" {
			touched = append(touched, p.From)
		}
		if s.Base != "" {
			touched = append(touched, s.Base)
		}
		slices.Sort(touched)
		for _, idx := range slices.Compact(touched) {
			f, err := field(idx)
			if err != nil {
				return p, err
			}
			switch {
			case idx == s.Base:
				slices.Sort(excluded)
				add(idx, typeFilter(f, nil, excluded))
			case len(shown[idx]) == 0:
				if slices.Contains(s.Read, idx) {
					remove(idx, alias)
				}
			default:
				types := shown[idx]
				slices.Sort(types)
				add(idx, typeFilter(f, types, nil))
			}
		}
	}
	if p.Leaving != "" {
		q := elastic.NewBoolQuery().MustNot(elastic.NewTermQuery(FieldDeleted, true))
		if !p.Whole {
			f, err := field(p.Leaving)
			if err != nil {
				return p, err
			}
			q = q.Filter(elastic.NewTermQuery(f, m.Type))
		} else if len(s.Excluded) > 0 && p.Leaving == s.Base {
			f, err := field(p.Leaving)
			if err != nil {
				return p, err
			}
			q = q.MustNot(elastic.NewTermsQueryFromStrings(f, s.Excluded...))
		}
		p.LeavingQuery = q
	}
	p.actions = actions
	return p, nil
}

// ErrNotHealthy: the target generation's shards are not allocated as they
// must be before it goes live; nothing moved.
var ErrNotHealthy = errors.New("generation not healthy")

// WaitHealthy waits up to timeout for index to reach want ("green": every
// shard copy allocated; "yellow": every primary) and refuses with
// [ErrUnsafeMove] and [ErrNotHealthy], saying what is unallocated, when it
// does not.
func WaitHealthy(ctx context.Context, client *elastic.Client, index, want string, timeout time.Duration) error {
	secs := max(1, int(timeout.Round(time.Second)/time.Second))
	res, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method: http.MethodGet,
		Path:   "/_cluster/health/" + url.PathEscape(index),
		Params: url.Values{"wait_for_status": {want}, "timeout": {fmt.Sprintf("%ds", secs)}, "level": {"indices"}},
		// A timed-out wait answers 408 with the health as it is.
		IgnoreErrors: []int{http.StatusRequestTimeout},
	})
	if err != nil {
		return fmt.Errorf("read the health of %s: %w", index, err)
	}
	var h struct {
		Status   string `json:"status"`
		TimedOut bool   `json:"timed_out"`
		Indices  map[string]struct {
			Status             string `json:"status"`
			Replicas           int    `json:"number_of_replicas"`
			ActiveShards       int    `json:"active_shards"`
			Unassigned         int    `json:"unassigned_shards"`
			Initializing       int    `json:"initializing_shards"`
			ActivePrimaryShard int    `json:"active_primary_shards"`
		} `json:"indices"`
	}
	if err := json.Unmarshal(res.Body, &h); err != nil {
		return fmt.Errorf("decode the health of %s: %w", index, err)
	}
	if !h.TimedOut {
		return nil
	}
	i := h.Indices[index]
	return fmt.Errorf("%w: %w: generation %s is %s, not %s, after waiting %s (%d shard copies active, %d unassigned, %d initializing; index.number_of_replicas is %d): "+
		"searches would read it with fewer copies than they read now, so the aliases did not move. Wait for the replicas to be allocated "+
		"(GET _cluster/allocation/explain says why they are not), lower index.number_of_replicas of %s, or give the move more time (--health-timeout)",
		ErrUnsafeMove, ErrNotHealthy, index, cmpStatus(i.Status, h.Status), want, time.Duration(secs)*time.Second, i.ActiveShards, i.Unassigned, i.Initializing, i.Replicas, index)
}

func cmpStatus(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// indexHealth returns index's health status ("green", "yellow", "red").
func indexHealth(ctx context.Context, client *elastic.Client, index string) (string, error) {
	res, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method: http.MethodGet,
		Path:   "/_cluster/health/" + url.PathEscape(index),
	})
	if err != nil {
		return "", fmt.Errorf("read the health of %s: %w", index, err)
	}
	var h struct {
		Status string `json:"status"`
	}
	if err := json.Unmarshal(res.Body, &h); err != nil {
		return "", fmt.Errorf("decode the health of %s: %w", index, err)
	}
	return h.Status, nil
}

// ApplyMove ends the target's bulk-load mode, waits for its health (green
// when the generation it replaces is green, else its primaries), makes the
// plan's one _aliases call, and then records where the job's documents came
// from in the target's _meta (for a rollback). moved reports that the
// _aliases call succeeded, also when recording the move failed after it.
//
// The record is written after the call, not before: a record of a move
// that did not happen (the call failed, or the process died before it)
// would make [WasLiveFor] true for a generation never live, and automatic
// cutovers would leave it as rolled back from for good. If the process
// dies between the call and the record, the aliases moved and nothing
// records it: a rollback then refuses (no previous generation recorded)
// instead of acting on a record of a move that never happened; that is
// the safe side.
func ApplyMove(ctx context.Context, client *elastic.Client, p MovePlan) (moved bool, err error) {
	m := p.Move
	gens, err := ListGenerations(ctx, client, m.Target)
	if err != nil {
		return false, err
	}
	if len(gens) != 1 {
		return false, fmt.Errorf("%w: index %s does not exist", ErrUnsafeMove, m.Target)
	}
	meta := gens[0].Meta
	if meta.BulkLoad != nil {
		// Still in bulk-load mode (refresh off): searches would not see
		// what it holds, nor anything written to it later.
		if err := restoreSettings(ctx, client, m.Target, *meta.BulkLoad); err != nil {
			return false, err
		}
		meta.BulkLoad = nil
		if err := PutMeta(ctx, client, m.Target, meta); err != nil {
			return false, err
		}
	}
	if p.Noop {
		return false, nil
	}
	want := "yellow"
	if p.From != "" {
		st, err := indexHealth(ctx, client, p.From)
		if err != nil {
			return false, err
		}
		if st == "green" {
			want = "green"
		}
	}
	timeout := m.HealthTimeout
	if timeout <= 0 {
		timeout = DefaultHealthTimeout
	}
	if err := WaitHealthy(ctx, client, m.Target, want, timeout); err != nil {
		return false, err
	}
	var uuid string
	if p.From != "" && p.From != m.Target {
		// Read before the call: the generation left may be dropped soon
		// after it.
		if uuid, err = UUID(ctx, client, p.From); err != nil {
			return false, err
		}
	}
	if err := UpdateAliases(ctx, client, p.actions); err != nil {
		return false, fmt.Errorf("move the documents of aggregate type %q of alias %s to %s (someone else moved the aliases meanwhile?): %w", m.Type, p.Before.Alias, m.Target, err)
	}
	now := time.Now().UTC().Format(time.RFC3339)
	if p.From != "" && p.From != m.Target {
		if p.Whole {
			meta.Previous, meta.PreviousUUID = p.From, uuid
		}
		if m.Type != "" {
			if meta.Sources == nil {
				meta.Sources = map[string]SourceMoveMeta{}
			}
			meta.Sources[m.Type] = SourceMoveMeta{Previous: p.From, PreviousUUID: uuid, At: now}
		}
	} else if m.Type != "" {
		if meta.Sources == nil {
			meta.Sources = map[string]SourceMoveMeta{}
		}
		meta.Sources[m.Type] = SourceMoveMeta{At: now}
	}
	meta.CutoverAt = now
	// The aliases moved: record it even when ctx ended meanwhile.
	if err := PutMeta(context.WithoutCancel(ctx), client, m.Target, meta); err != nil {
		return true, fmt.Errorf("the documents of aggregate type %q of alias %s moved to %s, but recording the move in its _meta failed (a rollback will refuse: no previous generation recorded): %w", m.Type, p.Before.Alias, m.Target, err)
	}
	return true, nil
}

// SourceMoveMeta records, in a generation's _meta, the last move of one
// aggregate type (a job's documents) to it.
type SourceMoveMeta struct {
	Previous     string `json:"previous,omitempty"`
	PreviousUUID string `json:"previous_uuid,omitempty"`
	At           string `json:"at,omitempty"`
}

// PreviousOf returns the generation typ's documents were live in before
// they last moved to index, and that index's uuid then ("" when none is
// recorded); for typ "" or a generation without per-type records, the
// whole-alias previous generation.
func PreviousOf(ctx context.Context, client *elastic.Client, index, typ string) (prev, uuid string, err error) {
	gens, err := ListGenerations(ctx, client, index)
	if err != nil || len(gens) != 1 {
		return "", "", err
	}
	if sm, ok := gens[0].Meta.Sources[typ]; ok && typ != "" && sm.Previous != "" {
		return sm.Previous, sm.PreviousUUID, nil
	}
	return gens[0].Meta.Previous, gens[0].Meta.PreviousUUID, nil
}

// WasLiveFor reports whether typ's documents were ever moved to index (or
// the whole alias, for a generation without per-type records).
func WasLiveFor(g Generation, typ string) bool {
	if _, ok := g.Meta.Sources[typ]; ok {
		return true
	}
	return len(g.Meta.Sources) == 0 && g.Meta.CutoverAt != ""
}

// A job's move (cutover, rollback, roll-forward) changes what searches find
// of that job only: see [PlanMove] for the job-aware read alias. The
// steps, under the alias's advisory lock (the one AUTO_CUTOVER takes, so
// moves of one alias never interleave):
//
//  1. plan the one _aliases call from the alias as it is;
//  2. count the documents without a processor version (application
//     events) that the move takes out of searches and the target lacks (a
//     tombstone in the target counts as having it: the row was deleted);
//     refuse unless allowed;
//  3. wait for the target's health, make the call, record the move in the
//     target's _meta (ApplyMove);
//  4. close the window between 2 and 3: documents without a processor
//     version written into the generation left between the count and the
//     call are copied into the target (at their external version).

// MoveOptions configure [MoveJob].
type MoveOptions struct {
	// Job names the job in messages.
	Job string
	// AllowUnversioned lets the move hide documents without a processor
	// version that the target lacks; otherwise it refuses.
	AllowUnversioned bool
	// Locked: the caller holds the alias's cutover lock already (see
	// [LockAlias]).
	Locked bool
	// BeforeMove, if set, runs between the count of documents without a
	// processor version and the alias move (tests: a write in the window).
	BeforeMove func()
	// AfterMove, if set, runs right after the alias move; an error it
	// returns fails the move as a step after the call would (tests).
	AfterMove func() error
	// Logger gets a line when documents are copied over; default
	// slog.Default().
	Logger *slog.Logger
}

// MoveResult is what [MoveJob] did.
type MoveResult struct {
	Plan    MovePlan
	Hidden  int64 // documents without a processor version the move hid (allowed)
	Copied  int64 // written into the generation left during the move, copied over
	Already bool
	// Moved: the _aliases call was made, also when MoveJob fails at a
	// later step (searches read the target then: record it as live).
	Moved bool
	// From lists the generation the job's documents left (empty: none).
	From []string
}

// LockAlias takes alias's cutover lock on its own connection, waiting for
// it; the returned function lets go.
func LockAlias(ctx context.Context, db *pgxpool.Pool, alias string) (func(), error) {
	conn, err := db.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("take the cutover lock of alias %s: %w", alias, err)
	}
	key := cutoverLockKey(alias)
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, key); err != nil {
		conn.Release()
		return nil, fmt.Errorf("take the cutover lock of alias %s: %w", alias, err)
	}
	return func() {
		_ = pgconn.ReleaseAdvisoryLock(ctx, conn.Conn(), key)
		conn.Release()
	}, nil
}

// MoveJob moves the documents of one job (aggregate type m.Type) of alias
// to m.Target, under the alias's cutover lock (taken here unless
// opts.Locked). The caller ran the readiness checks; m.JobTypes lists the
// aggregate types of every job that writes the alias.
func MoveJob(ctx context.Context, client *elastic.Client, db *pgxpool.Pool, alias, writeAlias string, m JobMove, opts MoveOptions) (MoveResult, error) {
	var res MoveResult
	if !opts.Locked {
		unlock, err := LockAlias(ctx, db, alias)
		if err != nil {
			return res, err
		}
		defer unlock()
	}
	target := m.Target
	plan, err := PlanMove(ctx, client, alias, writeAlias, m)
	res.Plan = plan
	if err != nil {
		return res, err
	}
	if plan.Noop {
		res.Already = true
		_, err := ApplyMove(ctx, client, plan) // ends a bulk load left over, nothing else
		return res, err
	}
	if plan.Leaving != "" {
		n, _, err := hiddenUnversioned(ctx, client, plan.Leaving, plan.LeavingQuery, target, false)
		if err != nil {
			return res, err
		}
		if n > 0 && !opts.AllowUnversioned {
			return res, fmt.Errorf("%w: move of job %s to %s: %s holds %d document(s) without a processor version "+
				"(events enqueued by an application, not by a batcher job) that %s lacks; after the move searches would no longer find them. "+
				"Enqueue them again so they reach %s, or accept losing them from searches with --allow-unversioned",
				ErrUnsafeMove, opts.Job, target, plan.Leaving, n, target, target)
		}
		res.Hidden = n
		if !plan.Whole && plan.Leaving == plan.OldBase {
			// The base keeps showing documents without an aggregate type:
			// some of them would now be found twice.
			dup, err := untypedTwice(ctx, client, plan.Leaving, target)
			if err != nil {
				return res, err
			}
			if dup > 0 {
				return res, fmt.Errorf("%w: move of job %s to %s: %s holds %d document(s) without %s (indexed before the indexer recorded it) whose ids %s holds too: "+
					"they would be found twice, since a move of one job of several keeps showing documents it cannot attribute. "+
					"Have them indexed again (indexer reconcile --job %s --repair at the live version) or remove them, then cut over",
					ErrUnsafeMove, opts.Job, target, plan.Leaving, dup, FieldAggregateType, target, opts.Job)
			}
		}
	}
	if opts.BeforeMove != nil {
		opts.BeforeMove()
	}
	res.Moved, err = ApplyMove(ctx, client, plan)
	if res.Moved {
		res.From = []string{}
		if plan.From != "" {
			res.From = []string{plan.From}
		}
	}
	if err != nil {
		return res, err
	}
	if opts.AfterMove != nil {
		if err := opts.AfterMove(); err != nil {
			return res, err
		}
	}
	if plan.Leaving != "" && !opts.AllowUnversioned {
		// Written between the count and the call: copy them over.
		if err := Refresh(ctx, client, plan.Leaving); err != nil {
			return res, err
		}
		n, ids, err := hiddenUnversioned(ctx, client, plan.Leaving, plan.LeavingQuery, target, true)
		if err != nil {
			return res, err
		}
		if n > 0 {
			if err := CopyDocs(ctx, client, plan.Leaving, target, ids); err != nil {
				return res, err
			}
			res.Copied = n
			cmp.Or(opts.Logger, slog.Default()).Info("documents without a processor version written into the generation left during the move were copied to the new one",
				slog.String("from", plan.Leaving), slog.String("index", target), slog.Int64("documents", n))
		}
	}
	return res, nil
}

// hiddenUnversioned counts the documents of from that q selects and that
// carry no processor version whose id target lacks (any document of that
// id, a tombstone included, counts as having it: a row deleted during the
// rebuild is not an application document). With ids set it also returns
// them.
func hiddenUnversioned(ctx context.Context, client *elastic.Client, from string, q elastic.Query, target string, ids bool) (int64, []string, error) {
	sel := elastic.NewBoolQuery().Filter(q).MustNot(elastic.NewExistsQuery(FieldPV))
	return scrollAbsent(ctx, client, from, sel, target, elastic.NewMatchAllQuery(), ids)
}

// untypedTwice counts the live documents of base without an aggregate type
// whose id target holds live.
func untypedTwice(ctx context.Context, client *elastic.Client, base, target string) (int64, error) {
	sel := elastic.NewBoolQuery().MustNot(elastic.NewExistsQuery(FieldAggregateType), elastic.NewTermQuery(FieldDeleted, true))
	var twice int64
	err := scrollPages(ctx, client, base, sel, func(page []string) error {
		found, err := client.Count(target).Query(elastic.NewBoolQuery().Filter(elastic.NewIdsQuery().Ids(page...)).
			MustNot(elastic.NewTermQuery(FieldDeleted, true))).Do(ctx)
		twice += found
		return err
	})
	return twice, err
}

// scrollAbsent counts (and lists, with ids) the documents of from that sel
// selects whose id no document of target that in selects has.
func scrollAbsent(ctx context.Context, client *elastic.Client, from string, sel elastic.Query, target string, in elastic.Query, ids bool) (int64, []string, error) {
	var n int64
	var out []string
	err := scrollPages(ctx, client, from, sel, func(page []string) error {
		res, err := client.Search(target).Query(elastic.NewBoolQuery().Filter(elastic.NewIdsQuery().Ids(page...), in)).
			Size(len(page)).FetchSource(false).Do(ctx)
		if err != nil {
			return fmt.Errorf("look up documents in %s: %w", target, err)
		}
		have := map[string]bool{}
		for _, h := range res.Hits.Hits {
			have[h.Id] = true
		}
		for _, id := range page {
			if !have[id] {
				n++
				if ids {
					out = append(out, id)
				}
			}
		}
		return nil
	})
	return n, out, err
}

// scrollPages calls fn with the ids of each page of index's documents q
// selects.
func scrollPages(ctx context.Context, client *elastic.Client, index string, q elastic.Query, fn func([]string) error) error {
	scroll := client.Scroll(index).Query(q).Size(1000).FetchSource(false)
	defer func() { _ = scroll.Clear(context.WithoutCancel(ctx)) }()
	for {
		page, err := scroll.Do(ctx)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("list documents of %s: %w", index, err)
		}
		ids := make([]string, 0, len(page.Hits.Hits))
		for _, h := range page.Hits.Hits {
			ids = append(ids, h.Id)
		}
		if len(ids) == 0 {
			return nil
		}
		if err := fn(ids); err != nil {
			return err
		}
	}
}

// CopyDocs copies the documents ids of from into index at their external
// version (a newer one already in index wins), in pages.
func CopyDocs(ctx context.Context, client *elastic.Client, from, index string, ids []string) error {
	for len(ids) > 0 {
		page := ids[:min(len(ids), 1000)]
		ids = ids[len(page):]
		if err := reindexExternal(ctx, client, from, index, map[string]any{"ids": map[string]any{"values": page}}); err != nil {
			return fmt.Errorf("copy documents of %s to %s: %w", from, index, err)
		}
	}
	return nil
}

// reindexExternal copies the documents of from that query selects (nil:
// all) into index at their external version (older ones than index holds
// are skipped), refreshing index.
func reindexExternal(ctx context.Context, client *elastic.Client, from, index string, query map[string]any) error {
	source := map[string]any{"index": from}
	if query != nil {
		source["query"] = query
	}
	res, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method: http.MethodPost,
		Path:   "/_reindex",
		Params: url.Values{"refresh": {"true"}},
		Body: map[string]any{
			"conflicts": "proceed",
			"source":    source,
			"dest":      map[string]any{"index": index, "version_type": "external"},
		},
	})
	if err != nil {
		return err
	}
	var out struct {
		Failures []json.RawMessage `json:"failures"`
	}
	if err := json.Unmarshal(res.Body, &out); err != nil {
		return fmt.Errorf("decode answer: %w", err)
	}
	if len(out.Failures) > 0 {
		return fmt.Errorf("%d failure(s), first: %s", len(out.Failures), out.Failures[0])
	}
	return nil
}

// TryLockAlias takes alias's cutover lock when no one holds it, on its own
// connection; ok is false when another session holds it. unlock lets go.
func TryLockAlias(ctx context.Context, db *pgxpool.Pool, alias string) (unlock func(), ok bool, err error) {
	conn, err := db.Acquire(ctx)
	if err != nil {
		return nil, false, err
	}
	key := cutoverLockKey(alias)
	var locked bool
	if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, key).Scan(&locked); err != nil {
		conn.Release()
		return nil, false, fmt.Errorf("take the cutover lock of alias %s: %w", alias, err)
	}
	if !locked {
		conn.Release()
		return nil, false, nil
	}
	return func() {
		// Bounded: a stalled database must not hold up the indexer's shutdown.
		_ = pgconn.ReleaseAdvisoryLock(ctx, conn.Conn(), key)
		conn.Release()
	}, true, nil
}

// cutoverLockKey is the advisory lock key of the moves of alias.
func cutoverLockKey(alias string) int64 {
	h := fnv.New64a()
	h.Write([]byte("outboxrelay.cutover:" + strings.ToLower(alias)))
	return int64(h.Sum64())
}

// Why [Candidate] finds a generation no candidate for an automatic cutover.
const (
	SkipMissing    = "missing"     // no indexer has created it yet
	SkipLive       = "live"        // the read alias shows the job's documents there
	SkipRolledBack = "rolled back" // live before, not now
)

// Candidate says why index, a generation of alias, is no candidate for an
// automatic cutover of the documents of aggregate type typ (one of the
// Skip reasons), or "" when it is one: it exists, they are not live
// there, and it records no move of them to it.
func Candidate(ctx context.Context, client *elastic.Client, alias, writeAlias, index, typ string) (string, error) {
	gens, err := Generations(ctx, client, alias, writeAlias)
	if err != nil {
		return "", err
	}
	state, err := ReadAliasState(ctx, client, alias, writeAlias)
	if err != nil {
		return "", err
	}
	i := slices.IndexFunc(gens, func(g Generation) bool { return g.Index == index })
	switch {
	case i < 0:
		return SkipMissing, nil
	case state.LiveOf(typ) == index:
		return SkipLive, nil
	case WasLiveFor(gens[i], typ):
		return SkipRolledBack, nil
	}
	return "", nil
}

// RollbackTarget returns the generation the documents of job (aggregate
// type typ) of alias were live in before they last moved to the one they
// are live in now. It refuses with [ErrUnsafeMove] when they are live
// nowhere, no previous generation is recorded, or it was dropped (or
// dropped and created again since).
func RollbackTarget(ctx context.Context, client *elastic.Client, alias, writeAlias, job, typ string) (Generation, error) {
	state, err := ReadAliasState(ctx, client, alias, writeAlias)
	if err != nil {
		return Generation{}, err
	}
	live := state.LiveOf(typ)
	if live == "" {
		return Generation{}, fmt.Errorf("%w: the documents of job %s (aggregate type %q) are live in no generation of alias %s", ErrUnsafeMove, job, typ, alias)
	}
	prev, uuid, err := PreviousOf(ctx, client, live, typ)
	if err != nil {
		return Generation{}, err
	}
	if prev == "" {
		return Generation{}, fmt.Errorf("%w: generation %s, where the documents of job %s are live, records no previous generation to roll back to", ErrUnsafeMove, live, job)
	}
	gens, err := Generations(ctx, client, alias, writeAlias)
	if err != nil {
		return Generation{}, err
	}
	i := slices.IndexFunc(gens, func(g Generation) bool { return g.Index == prev })
	if i < 0 {
		return Generation{}, fmt.Errorf("%w: previous generation %s of job %s (alias %s) no longer exists (dropped)", ErrUnsafeMove, prev, job, alias)
	}
	if uuid != "" {
		now, err := UUID(ctx, client, prev)
		if err != nil {
			return Generation{}, err
		}
		if now != uuid {
			return Generation{}, fmt.Errorf("%w: previous generation %s of job %s was dropped and created again since the cutover "+
				"(by an indexer that received an event of processor version %s): it holds only what arrived since (%d documents); "+
				"rebuild it (batcher run at that version, then indexer cutover --job) instead",
				ErrUnsafeMove, prev, job, gens[i].Meta.ProcessorVersion, gens[i].Docs)
		}
	}
	return gens[i], nil
}
