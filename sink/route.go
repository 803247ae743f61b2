package sink

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strings"

	"github.com/cenkalti/backoff/v4"
	"github.com/olivere/elastic/v7"
	"github.com/segmentio/kafka-go"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// What a null value (a Kafka tombstone) that is not a delete event means:
// Config.NullValues, as the Kafka Connect Elasticsearch sink's
// behavior.on.null.values.
const (
	NullValuesFail   = "fail"   // dead-lettered (null_value, or missing_document for an upsert event)
	NullValuesIgnore = "ignore" // skipped, counted
	NullValuesDelete = "delete" // a delete of the key
)

// _id formats: Config.IDFormat.
const (
	IDFormatID     = "id"      // _id = the Kafka key (the aggregate id)
	IDFormatTypeID = "type:id" // _id = "<ce_aggregatetype>:<key>"
)

// recordRules are the parts of the configuration that decide what a
// record becomes: which alias, which _id, skipped or not.
type recordRules struct {
	maxDocBytes    int
	alias          string
	writeAlias     string
	routes         map[string]string // aggregate type → read alias
	aggregateTypes map[string]bool   // nil: every type
	skipEventTypes map[string]bool
	skipAllOthers  bool // SkipEventTypes has "*"
	nullValues     string
	typedIDs       bool
}

func newRecordRules(cfg Config) *recordRules {
	r := &recordRules{
		maxDocBytes: cfg.MaxDocumentBytes, alias: cfg.Alias, writeAlias: cfg.WriteAlias,
		routes: cfg.Routes, nullValues: cfg.NullValues, typedIDs: cfg.IDFormat == IDFormatTypeID,
		skipEventTypes: map[string]bool{},
	}
	if len(cfg.AggregateTypes) > 0 {
		r.aggregateTypes = map[string]bool{}
		for _, t := range cfg.AggregateTypes {
			r.aggregateTypes[t] = true
		}
	}
	for _, t := range cfg.SkipEventTypes {
		r.skipEventTypes[t] = true
		r.skipAllOthers = r.skipAllOthers || t == "*"
	}
	return r
}

// targetAlias returns the read alias a record belongs to: the route of its
// aggregate type (ce_aggregatetype) in Config.Routes, else Config.Alias.
// It is the one place that decides it; which index an alias writes to is
// decided after it, from the alias.
func (r *recordRules) targetAlias(m kafka.Message) string {
	if len(r.routes) == 0 {
		return r.alias
	}
	if t, ok := headerBytes(m, outbox.HeaderAggregateType); ok {
		if a, ok := r.routes[string(t)]; ok {
			return a
		}
	}
	return r.alias
}

// writeAliasOf returns the alias the indexer writes through for a read
// alias: Config.WriteAlias for Config.Alias, "<alias>-write" for a route.
func (r *recordRules) writeAliasOf(alias string) string {
	if alias == r.alias {
		return r.writeAlias
	}
	return alias + "-write"
}

// aliases returns every read alias records may go to, Config.Alias first.
func (r *recordRules) aliases() []string {
	out := []string{r.alias}
	for _, a := range r.routes {
		if !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	slices.Sort(out[1:])
	return out
}

func (r *recordRules) skipsEventType(typ []byte) bool {
	return r.skipAllOthers || r.skipEventTypes[string(typ)]
}

// ParseRoutes parses ROUTES: "type=alias,type=alias".
func ParseRoutes(s string) (map[string]string, error) {
	out := map[string]string{}
	for _, kv := range strings.Split(s, ",") {
		if kv = strings.TrimSpace(kv); kv == "" {
			continue
		}
		typ, alias, ok := strings.Cut(kv, "=")
		typ, alias = strings.TrimSpace(typ), strings.TrimSpace(alias)
		if !ok || typ == "" || alias == "" {
			return nil, fmt.Errorf("ROUTES=%q: %q is not aggregate_type=alias", s, kv)
		}
		if prev, dup := out[typ]; dup && prev != alias {
			return nil, fmt.Errorf("ROUTES=%q: aggregate type %q routed twice", s, typ)
		}
		out[typ] = alias
	}
	return out, nil
}

// ensureIndexes makes sure every alias records may go to exists (see
// [index.Ensure]) and returns the index behind Config.WriteAlias. It maps
// FieldDeletedAt, which tombstones carry (see [index.Create]). With
// NullValues "delete" it also maps FieldPosition, which the documents then
// carry: an index with a strict mapping would refuse every one of them.
func (ix *Indexer) ensureIndexes(ctx context.Context) (string, error) {
	var first string
	for i, alias := range ix.rules.aliases() {
		idx, err := index.Ensure(ctx, ix.client, alias, ix.rules.writeAliasOf(alias), ix.cfg.Mapping)
		if err != nil {
			return "", err
		}
		// Indices created before tombstones carried FieldDeletedAt: a
		// strict mapping would refuse every tombstone. An index that maps
		// the field otherwise already is left as it is.
		if _, err := ix.client.PerformRequest(ctx, elastic.PerformRequestOptions{
			Method: http.MethodPut, Path: "/" + url.PathEscape(idx) + "/_mapping",
			Body: map[string]any{"properties": map[string]any{FieldDeletedAt: index.DeletedAtMapping()}},
		}); err != nil {
			ix.log.Warn("cannot map "+FieldDeletedAt+" (tombstone purge times)", slog.String("index", idx), slog.String("error", err.Error()))
		}
		if ix.cfg.NullValues == NullValuesDelete {
			if _, err := ix.client.PerformRequest(ctx, elastic.PerformRequestOptions{
				Method: http.MethodPut, Path: "/" + url.PathEscape(idx) + "/_mapping",
				Body: map[string]any{"properties": map[string]any{FieldPosition: map[string]any{"type": "long"}}},
			}); err != nil {
				return "", fmt.Errorf("map %s in index %s (NULL_VALUES=delete): %w", FieldPosition, idx, err)
			}
		}
		if i == 0 {
			first = idx
		}
	}
	return first, nil
}

// versionsFromIndex gives the deletes that carry no version (null values
// from other producers, with NullValues "delete") the version their id has
// in the index now, or that of an earlier record of the same id in the
// batch when higher; they are written with version_type=external_gte. So
// the tombstone hides exactly what is indexed, a later record of the key
// with a higher version still goes through, and a late replay of an older
// or equal one is a conflict. An id not in the index gets version 0.
//
// Such a delete is replayed after a crash or a rebalance, and by then the
// index may hold a later record of the id (same topic and partition,
// higher offset, by FieldPosition): taking that record's version would
// hide it for good, so the delete is marked overtaken instead. A topic
// deleted and created again under the same name numbers its offsets from 0
// again: until they pass the old ones, its null values of ids written
// before are taken for replays.
func (ix *Indexer) versionsFromIndex(ctx context.Context, batch []*doc) error {
	var need []*doc
	for _, d := range batch {
		if d.versionFromIndex {
			need = append(need, d)
		}
	}
	if len(need) == 0 {
		return nil
	}
	type mgetReq struct {
		Index  string   `json:"_index"`
		ID     string   `json:"_id"`
		Source []string `json:"_source"`
	}
	req := struct {
		Docs []mgetReq `json:"docs"`
	}{}
	for _, d := range need {
		req.Docs = append(req.Docs, mgetReq{Index: d.target, ID: d.id, Source: []string{FieldPosition}})
	}
	var got struct {
		Docs []struct {
			Found   bool  `json:"found"`
			Version int64 `json:"_version"`
			Source  struct {
				Position []int64 `json:"_pos"`
			} `json:"_source"`
			// A document the engine could not look up (a shard not
			// available, the index briefly gone) is not "not found":
			// it is asked again.
			Error *bulkItemError `json:"error"`
		} `json:"docs"`
	}
	err := backoff.Retry(func() error {
		res, err := ix.client.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodPost, Path: "/_mget", Body: req})
		if err != nil {
			if !index.IsRetryable(err) {
				return backoff.Permanent(err)
			}
			return err
		}
		got.Docs = nil
		if err := json.NewDecoder(bytes.NewReader(res.Body)).Decode(&got); err != nil || len(got.Docs) != len(need) {
			return backoff.Permanent(fmt.Errorf("bad _mget answer (%v)", err))
		}
		for i, g := range got.Docs {
			if g.Error != nil {
				return fmt.Errorf("_mget of %q in %s: %s: %s", need[i].id, need[i].target, g.Error.Type, g.Error.Reason)
			}
		}
		return nil
	}, ix.newBackOff(ctx))
	if err != nil {
		return fmt.Errorf("read the versions of %d null-value delete(s): %w", len(need), err)
	}
	type key [2]string
	current := map[key]int64{}
	type position struct{ partition, offset, topic int64 }
	written := map[key]position{} // where the indexed document came from
	for i, d := range need {
		g := got.Docs[i]
		if !g.Found {
			continue
		}
		k := key{d.target, d.id}
		current[k] = g.Version
		switch p := g.Source.Position; len(p) {
		case 2: // written before positions held the topic: this one's
			written[k] = position{p[0], p[1], topicTag(d.msg.Topic)}
		case 3:
			written[k] = position{p[0], p[1], p[2]}
		}
	}
	for _, d := range batch { // in order: an earlier record of the id counts
		k := key{d.target, d.id}
		if d.versionFromIndex {
			if p, ok := written[k]; ok && p.topic == topicTag(d.msg.Topic) && p.partition == int64(d.msg.Partition) && p.offset > d.msg.Offset {
				d.overtaken = true
				continue
			}
			d.version = current[k]
			d.idv = IDV(d.id, d.version, true, d.pv)
		} else if d.poison == nil && d.skip == "" {
			current[k] = max(current[k], d.version)
		}
	}
	return nil
}

// ForAggregateType returns c with Alias and WriteAlias those records of
// aggregate type typ go to (ROUTES), for commands that work on one job's
// alias (cutover, reconcile --job).
func (c Config) ForAggregateType(typ string) Config {
	c = c.Unrouted()
	if a, ok := c.Routes[typ]; ok && a != c.Alias {
		c.routedFrom = &[2]string{c.Alias, c.WriteAlias}
		c.Alias, c.WriteAlias = a, a+"-write"
	}
	return c
}

// Unrouted returns c as it was before ForAggregateType routed it (c itself
// when it was not): Alias and WriteAlias are the main ones again.
func (c Config) Unrouted() Config {
	c = c.withDefaults()
	if c.routedFrom != nil {
		c.Alias, c.WriteAlias = c.routedFrom[0], c.routedFrom[1]
		c.routedFrom = nil
	}
	return c
}
