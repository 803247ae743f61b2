package index

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/olivere/elastic/v7"
)

// An index generation is the physical index that holds the documents one
// processor version built for one alias: GenerationIndex(alias, pv). The
// indexer writes a document that carries a processor version (header
// ce_processorversion) into its generation, creating the index from the
// mapping the first time it sees the version. The write alias (where
// documents without a processor version go) points at one generation, the
// base; the read alias (what users search) spans the generations the jobs
// of the alias are live in, each with a filter on the jobs live there
// ([AliasState], [PlanMove]). A job's documents move from one generation
// to another only by [MoveJob] (package reconcile's Cutover and Rollback,
// after their checks), in one _aliases call. So a new normalizer builds
// its documents beside the live ones and searches never see a half-built
// index.

// metaKey is the key of the index mapping's _meta object this package
// owns.
const metaKey = "outboxrelay"

// GenerationMeta is stored in a generation's mapping (_meta.outboxrelay).
type GenerationMeta struct {
	Alias            string `json:"alias"`
	ProcessorVersion string `json:"processor_version"`
	CreatedAt        string `json:"created_at,omitempty"`
	// Previous is the generation the aliases left when they last moved
	// whole to this one (a rollback goes back there); CutoverAt is when.
	// PreviousUUID is that index's uuid then: an index of the same name
	// created again since (dropped, then re-created by an indexer that got
	// a replayed event of its version) has another one.
	Previous     string `json:"previous,omitempty"`
	PreviousUUID string `json:"previous_uuid,omitempty"`
	CutoverAt    string `json:"cutover_at,omitempty"`
	// Sources records, per aggregate type (job), the last move of its
	// documents to this generation (see [PlanMove]).
	Sources map[string]SourceMoveMeta `json:"sources,omitempty"`
	// BulkLoad is set while the generation is in bulk-load mode (see
	// FinishBulkLoad): the settings to restore.
	BulkLoad *BulkLoad `json:"bulk_load,omitempty"`
}

// maxIndexName leaves room under the engines' 255-byte limit for the
// generation's write alias suffix.
const maxIndexName = 200

// GenerationIndex returns the physical index of alias's generation for
// processor version pv: "<alias>_<pv>", lowercased, with every character
// an index name cannot hold replaced by '-'. When that changed the string
// (or it had to be shortened), a short hash of pv is appended, so two
// versions never share an index ("V2" and "v2" are different versions).
// GenerationIndex("records", "v1") is "records_v1", the name the indexer
// has always given its first index.
func GenerationIndex(alias, pv string) string {
	raw := alias + "_" + pv
	var b strings.Builder
	for _, r := range strings.ToLower(raw) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9', r == '_', r == '-', r == '.':
			b.WriteRune(r)
		default:
			b.WriteByte('-')
		}
	}
	name := b.String()
	if name == raw && len(name) <= maxIndexName {
		return name
	}
	sum := sha256.Sum256([]byte(pv))
	return name[:min(len(name), maxIndexName-9)] + "-" + hex.EncodeToString(sum[:4])
}

// GenerationWriteAlias is the alias the indexer writes a generation
// through (usually the index GenerationIndex names; after indexer reindex,
// the copy). Bulk requests require an alias (a missing index must fail the
// items rather than be auto-created with a dynamic mapping), so every
// generation has its own.
func GenerationWriteAlias(index string) string { return index + "-write" }

// CreateGeneration creates the generation index for pv from mapping, with
// its write alias and its _meta, plus extra aliases. An index that already
// exists (another indexer won the race, or an index created before
// generations had _meta: the adopt step) gets the write alias and, when it
// has none, the _meta.
// In bulk-load mode when bulk is set (a generation the indexer builds from
// a topic: see [FinishBulkLoad]).
func CreateGeneration(ctx context.Context, client *elastic.Client, alias, pv string, mapping []byte, extra map[string]any, bulk bool) (string, error) {
	index := GenerationIndex(alias, pv)
	if err := checkAdoptable(ctx, client, alias, pv, index); err != nil {
		return "", err
	}
	meta := GenerationMeta{Alias: alias, ProcessorVersion: pv, CreatedAt: time.Now().UTC().Format(time.RFC3339Nano)}
	if bulk {
		var m map[string]any
		if err := json.Unmarshal(mapping, &m); err != nil {
			return "", fmt.Errorf("index mapping is not a JSON object: %w", err)
		}
		meta.BulkLoad = withBulkLoad(m)
		var err error
		if mapping, err = json.Marshal(m); err != nil {
			return "", err
		}
	}
	body, err := withMeta(mapping, meta)
	if err != nil {
		return "", err
	}
	aliases := map[string]any{GenerationWriteAlias(index): map[string]any{"is_write_index": true}}
	for k, v := range extra {
		aliases[k] = v
	}
	if err := Create(ctx, client, index, body, aliases); err != nil {
		return "", err
	}
	gens, err := ListGenerations(ctx, client, index)
	if err != nil {
		return "", err
	}
	if len(gens) == 1 && gens[0].Meta.ProcessorVersion == "" {
		// Adopted: the index existed without a processor version (the
		// empty one the indexer creates at its start has the name of the
		// first generation). Still empty, it is built like a new one.
		if meta.BulkLoad != nil {
			if meta.BulkLoad, err = adoptBulkLoad(ctx, client, index); err != nil {
				return "", err
			}
		}
		if err := PutMeta(ctx, client, index, meta); err != nil {
			return "", err
		}
		if meta.BulkLoad != nil {
			// After the _meta that records what to restore: a crash in
			// between leaves nothing that is not restored.
			if err := putSettings(ctx, client, index, map[string]any{"refresh_interval": "-1", "number_of_replicas": 0}); err != nil {
				return "", err
			}
		}
	} else if len(gens) == 1 && gens[0].Meta.ProcessorVersion != pv {
		return "", fmt.Errorf("index %s holds processor version %q, not %q: it is not the generation of %q", index, gens[0].Meta.ProcessorVersion, pv, pv)
	}
	return index, nil
}

// withMeta returns the create-index body with _meta.outboxrelay set.
func withMeta(mapping []byte, meta GenerationMeta) ([]byte, error) {
	var body map[string]any
	if err := json.Unmarshal(mapping, &body); err != nil {
		return nil, fmt.Errorf("index mapping is not a JSON object: %w", err)
	}
	mappings, _ := body["mappings"].(map[string]any)
	if mappings == nil {
		mappings = map[string]any{}
	}
	m, _ := mappings["_meta"].(map[string]any)
	if m == nil {
		m = map[string]any{}
	}
	m[metaKey] = meta
	mappings["_meta"] = m
	body["mappings"] = mappings
	return json.Marshal(body)
}

// PutMeta replaces the generation's _meta.outboxrelay (other _meta keys
// are kept).
func PutMeta(ctx context.Context, client *elastic.Client, index string, meta GenerationMeta) error {
	gens, err := ListGenerations(ctx, client, index)
	if err != nil {
		return err
	}
	all := map[string]any{}
	if len(gens) == 1 {
		for k, v := range gens[0].otherMeta {
			all[k] = v
		}
	}
	all[metaKey] = meta
	_, err = client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method: http.MethodPut,
		Path:   "/" + url.PathEscape(index) + "/_mapping",
		Body:   map[string]any{"_meta": all},
	})
	if err != nil {
		return fmt.Errorf("store generation metadata in %s: %w", index, err)
	}
	return nil
}

// CreatedAt is when g was created: Meta.CreatedAt (RFC 3339, with
// nanoseconds since two generations may be created within one second),
// the zero time when it has none.
func (g Generation) CreatedAt() time.Time {
	t, _ := time.Parse(time.RFC3339Nano, g.Meta.CreatedAt)
	return t
}

// Generation is one physical index of an alias, as [Generations] lists it.
type Generation struct {
	Index string
	Meta  GenerationMeta
	// Live: the read alias points here. Writes: the write alias does.
	Live, Writes bool
	// Docs counts documents, tombstones included; Tombstones counts those.
	Docs, Tombstones int64
	// Shows says, when the read alias spans several generations (several
	// jobs live in different ones), which documents it finds in this one:
	// "articles", or "all but articles" on the base generation; "" when
	// the read alias reads the whole generation.
	Shows     string
	otherMeta map[string]any
}

// ListGenerations reads the _meta of the indices pattern matches.
func ListGenerations(ctx context.Context, client *elastic.Client, pattern string) ([]Generation, error) {
	res, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method:       http.MethodGet,
		Path:         "/" + url.PathEscape(pattern) + "/_mapping",
		Params:       url.Values{"allow_no_indices": {"true"}, "ignore_unavailable": {"true"}},
		IgnoreErrors: []int{http.StatusNotFound},
	})
	if err != nil {
		return nil, fmt.Errorf("read mappings of %s: %w", pattern, err)
	}
	if res.StatusCode == http.StatusNotFound {
		return nil, nil
	}
	var body map[string]struct {
		Mappings struct {
			Meta map[string]json.RawMessage `json:"_meta"`
		} `json:"mappings"`
	}
	if err := json.Unmarshal(res.Body, &body); err != nil {
		return nil, fmt.Errorf("decode mappings of %s: %w", pattern, err)
	}
	var out []Generation
	for index, m := range body {
		g := Generation{Index: index, otherMeta: map[string]any{}}
		for k, v := range m.Mappings.Meta {
			if k == metaKey {
				_ = json.Unmarshal(v, &g.Meta) // a foreign shape reads as no metadata
				continue
			}
			g.otherMeta[k] = v
		}
		out = append(out, g)
	}
	slices.SortFunc(out, func(a, b Generation) int { return strings.Compare(a.Index, b.Index) })
	return out, nil
}

// Generations lists alias's generations: the indices its aliases point at
// and every index whose _meta names it (or, without _meta, named
// "<alias>_…"), with document counts.
func Generations(ctx context.Context, client *elastic.Client, alias, writeAlias string) ([]Generation, error) {
	read, err := AliasTargets(ctx, client, alias)
	if err != nil {
		return nil, err
	}
	write, err := AliasTargets(ctx, client, writeAlias)
	if err != nil {
		return nil, err
	}
	candidates, err := ListGenerations(ctx, client, alias+"_*")
	if err != nil {
		return nil, err
	}
	for _, idx := range slices.Concat(read, write) {
		if !slices.ContainsFunc(candidates, func(g Generation) bool { return g.Index == idx }) {
			gs, err := ListGenerations(ctx, client, idx)
			if err != nil {
				return nil, err
			}
			candidates = append(candidates, gs...)
		}
	}
	state, err := ReadAliasState(ctx, client, alias, writeAlias)
	if err != nil {
		return nil, err
	}
	var out []Generation
	for _, g := range candidates {
		if g.Meta.Alias != "" && g.Meta.Alias != alias {
			continue
		}
		g.Live, g.Writes = slices.Contains(read, g.Index), slices.Contains(write, g.Index)
		switch {
		case !g.Live:
		case g.Index == state.Base && len(state.Excluded) > 0:
			g.Shows = "all but " + strings.Join(state.Excluded, ", ")
		case g.Index != state.Base && state.Types[g.Index] != nil:
			g.Shows = strings.Join(state.Types[g.Index], ", ")
		}
		if g.Docs, err = CountDocs(ctx, client, g.Index, nil); err != nil {
			return nil, err
		}
		if g.Tombstones, err = CountDocs(ctx, client, g.Index, map[string]any{"term": map[string]any{FieldDeleted: true}}); err != nil {
			return nil, err
		}
		out = append(out, g)
	}
	slices.SortFunc(out, func(a, b Generation) int {
		return cmp.Or(a.CreatedAt().Compare(b.CreatedAt()), strings.Compare(a.Index, b.Index))
	})
	return out, nil
}

func CountDocs(ctx context.Context, client *elastic.Client, index string, query map[string]any) (int64, error) {
	var body any
	if query != nil {
		body = map[string]any{"query": query}
	}
	res, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodPost, Path: "/" + url.PathEscape(index) + "/_count", Body: body})
	if err != nil {
		return 0, fmt.Errorf("count documents of %s: %w", index, err)
	}
	var c struct {
		Count int64 `json:"count"`
	}
	if err := json.Unmarshal(res.Body, &c); err != nil {
		return 0, fmt.Errorf("count documents of %s: %w", index, err)
	}
	return c.Count, nil
}

// InBulkLoad reports whether index is a generation in bulk-load mode (see
// [FinishBulkLoad]).
func InBulkLoad(ctx context.Context, client *elastic.Client, index string) (bool, error) {
	gens, err := ListGenerations(ctx, client, index)
	if err != nil {
		return false, err
	}
	return len(gens) == 1 && gens[0].Meta.BulkLoad != nil, nil
}

// TakeOver moves alias's read and write aliases to index, a generation
// just created, when they point at the empty index the indexer creates at
// its start and that index belongs to no processor version (the first
// generation ever takes over from it); otherwise it does nothing.
func TakeOver(ctx context.Context, client *elastic.Client, log *slog.Logger, alias, writeAlias, index string) error {
	live, err := AliasTargets(ctx, client, alias)
	if err != nil || len(live) != 1 || live[0] == index {
		return err
	}
	gens, err := ListGenerations(ctx, client, live[0])
	if err != nil || len(gens) != 1 || gens[0].Meta.ProcessorVersion != "" {
		return err
	}
	n, err := CountDocs(ctx, client, live[0], nil)
	if err != nil || n > 0 {
		return err
	}
	writes, err := AliasTargets(ctx, client, writeAlias)
	if err != nil {
		return err
	}
	err = UpdateAliases(ctx, client, aliasMove(alias, writeAlias, live, writes, index))
	if err != nil {
		// Another indexer may have made the same move first (and copies).
		if now, err2 := AliasTargets(ctx, client, alias); err2 == nil && slices.Equal(now, []string{index}) {
			return nil
		}
		return err
	}
	log.Info("first generation is live", slog.String("alias", alias), slog.String("index", index), slog.String("bootstrap_index", live[0]))
	// An application event (no processor version) written through the
	// write alias between the count and the move landed in the bootstrap
	// index, which no alias reaches any more: copy it over, at its
	// external version, so a newer one already in index wins.
	return copyStragglers(ctx, client, live[0], index)
}

// copyStragglers copies every document of from into index at its external
// version (older ones than index holds are skipped).
func copyStragglers(ctx context.Context, client *elastic.Client, from, index string) error {
	if err := Refresh(ctx, client, from); err != nil {
		return err
	}
	n, err := CountDocs(ctx, client, from, nil)
	if err != nil || n == 0 {
		return err
	}
	if err := reindexExternal(ctx, client, from, index, nil); err != nil {
		return fmt.Errorf("copy the documents written into %s during the takeover to %s: %w", from, index, err)
	}
	return nil
}

// aliasMove is the one _aliases call that moves the read alias (with its
// tombstone filter) from the indices in readFrom and the write alias from
// those in writeFrom to index. It fails as a whole when an alias is no
// longer where they say.
func aliasMove(alias, writeAlias string, readFrom, writeFrom []string, index string) []any {
	var actions []any
	for _, f := range readFrom {
		actions = append(actions, map[string]any{"remove": map[string]any{"index": f, "alias": alias}})
	}
	for _, f := range writeFrom {
		actions = append(actions, map[string]any{"remove": map[string]any{"index": f, "alias": writeAlias}})
	}
	return append(actions,
		map[string]any{"add": map[string]any{"index": index, "alias": alias, "filter": notDeletedFilter}},
		map[string]any{"add": map[string]any{"index": index, "alias": writeAlias, "is_write_index": true}})
}

// Sentinel errors of the generation commands.
var (
	// ErrUnsafeMove: a cutover, rollback or drop was refused; nothing
	// changed. The error says what is missing.
	ErrUnsafeMove = errors.New("refused")
)

// GenerationExists reports whether index exists as a generation (with or
// without its _meta).
func GenerationExists(ctx context.Context, client *elastic.Client, index string) (bool, error) {
	gens, err := ListGenerations(ctx, client, index)
	return len(gens) == 1, err
}

// GenerationTarget returns the index holding alias's generation for pv:
// where its write alias points, else the index GenerationIndex names.
func GenerationTarget(ctx context.Context, client *elastic.Client, alias, pv string) (string, error) {
	index := GenerationIndex(alias, pv)
	targets, err := AliasTargets(ctx, client, GenerationWriteAlias(index))
	if err != nil {
		return "", err
	}
	if len(targets) == 1 {
		return targets[0], nil
	}
	return index, nil
}

// UUID returns index's index.uuid, which a new index of the same name
// does not share.
func UUID(ctx context.Context, client *elastic.Client, index string) (string, error) {
	res, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method: http.MethodGet,
		Path:   "/" + url.PathEscape(index) + "/_settings/index.uuid",
	})
	if err != nil {
		return "", fmt.Errorf("read uuid of index %s: %w", index, err)
	}
	var body map[string]struct {
		Settings struct {
			Index struct {
				UUID string `json:"uuid"`
			} `json:"index"`
		} `json:"settings"`
	}
	if err := json.Unmarshal(res.Body, &body); err != nil {
		return "", fmt.Errorf("decode uuid of index %s: %w", index, err)
	}
	return body[index].Settings.Index.UUID, nil
}

// GenerationOwner says why index (listed as gens: none when it does not
// exist) is not the generation of (alias, pv), or "".
func GenerationOwner(gens []Generation, alias, pv, index string) string {
	i := slices.IndexFunc(gens, func(g Generation) bool { return g.Index == index })
	switch {
	case i < 0:
		return ""
	case gens[i].Meta.Alias == alias && gens[i].Meta.ProcessorVersion == pv:
		return ""
	case gens[i].Meta.ProcessorVersion == "" && gens[i].Meta.Alias == "" && index == alias+"_v1" && pv == "v1":
		return "" // the bootstrap index, adopted by its first v1 event
	case gens[i].Meta.ProcessorVersion == "":
		return fmt.Sprintf("index %s, where processor version %q of alias %s would go, has no generation metadata (_meta.%s): "+
			"no indexer created it as a generation, and it is not adopted (only the index %s_v1 the indexer creates at its start is)",
			index, pv, alias, metaKey, alias)
	}
	return fmt.Sprintf("index %s, where processor version %q of alias %s would go, is the generation of processor version %q of alias %s: "+
		"nothing is written into another alias's or version's index",
		index, pv, alias, gens[i].Meta.ProcessorVersion, gens[i].Meta.Alias)
}

// checkAdoptable refuses to create (or adopt) the generation of (alias,
// pv) when the index it names exists and is not theirs; CreateGeneration
// calls it before it adds any alias to an existing index.
func checkAdoptable(ctx context.Context, client *elastic.Client, alias, pv, index string) error {
	gens, err := ListGenerations(ctx, client, index)
	if err != nil {
		return err
	}
	// An existing index of another name (index is an alias) is not created here.
	gens = slices.DeleteFunc(gens, func(g Generation) bool { return g.Index != index })
	if problem := GenerationOwner(gens, alias, pv, index); problem != "" {
		return fmt.Errorf("%w: %s", ErrUnsafeMove, problem)
	}
	return nil
}
