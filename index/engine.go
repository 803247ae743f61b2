package index

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"

	"github.com/olivere/elastic/v7"
)

// NewClient returns an olivere/elastic client for an engine address, or for
// several nodes of one cluster as a comma-separated list
// ("http://node1:9200,http://node2:9200").
// Sniffing and the health checker are off: they assume a cluster whose node
// addresses are reachable from here, which a single loopback node, a proxy
// or a managed service behind a load balancer are not. With several
// addresses, requests go to the listed nodes in turn; a node that gives no
// HTTP answer is marked dead and skipped until every listed node is, then all
// are tried again (the request that found a node dead fails, and the caller's
// retry goes to the next node).
func NewClient(rawURL string) (*elastic.Client, error) { return NewClientWith(rawURL, nil) }

// NewClientWith is NewClient sending its requests through hc (credentials,
// TLS: see internal/esconn); nil hc means a plain client.
func NewClientWith(rawURL string, hc *http.Client) (*elastic.Client, error) {
	if hc == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.MaxIdleConnsPerHost = 64
		hc = &http.Client{Transport: tr}
	}
	c, err := elastic.NewSimpleClient(
		elastic.SetURL(SplitURLs(rawURL)...),
		elastic.SetSniff(false),
		elastic.SetHealthcheck(false),
		elastic.SetHttpClient(hc),
	)
	if err != nil {
		return nil, fmt.Errorf("search engine client for ELASTICSEARCH_URL: %w", err)
	}
	return c, nil
}

// SplitURLs splits an ELASTICSEARCH_URL that lists several nodes
// ("http://a:9200, http://b:9200") into its addresses; empty items are
// dropped.
func SplitURLs(rawURL string) []string {
	var out []string
	for _, u := range strings.Split(rawURL, ",") {
		if u = strings.TrimSpace(u); u != "" {
			out = append(out, u)
		}
	}
	return out
}

// IsRetryable reports whether a failed request to the search engine may
// succeed when sent again: overload (429), timeouts (408), server errors
// (5xx) and anything that never got an HTTP answer (connection refused or
// reset, no node available). Other 4xx answers will not heal.
func IsRetryable(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	var ee *elastic.Error
	if errors.As(err, &ee) {
		return ee.Status == http.StatusTooManyRequests || ee.Status == http.StatusRequestTimeout || ee.Status >= 500
	}
	return true
}

// notDeletedFilter is the read alias filter that hides tombstones.
var notDeletedFilter = map[string]any{
	"bool": map[string]any{"must_not": []any{map[string]any{"term": map[string]any{FieldDeleted: true}}}},
}

// NotDeletedFilter returns the read alias filter that hides tombstones
// (of a read alias that spans one generation).
func NotDeletedFilter() map[string]any { return notDeletedFilter }

// AliasTargets returns the indices alias points at (none if it does not
// exist).
func AliasTargets(ctx context.Context, client *elastic.Client, alias string) ([]string, error) {
	res, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method:       http.MethodGet,
		Path:         "/_alias/" + url.PathEscape(alias),
		IgnoreErrors: []int{http.StatusNotFound},
	})
	if err != nil {
		return nil, fmt.Errorf("get alias %s: %w", alias, err)
	}
	if res.StatusCode == http.StatusNotFound {
		return nil, nil
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(res.Body, &m); err != nil {
		return nil, fmt.Errorf("decode alias %s: %w", alias, err)
	}
	out := make([]string, 0, len(m))
	for idx := range m {
		out = append(out, idx)
	}
	return out, nil
}

// ErrWriteAliasMissing: the read alias exists and the write alias does not.
// [Ensure] refuses to guess which index the writes belong to.
var ErrWriteAliasMissing = errors.New("write alias missing")

// Ensure makes sure the write alias exists. When neither alias does,
// it creates "<alias>_v1" from mapping with both aliases in the same call,
// so no reader ever sees one alias without the other. Several indexers may
// race here; the loser finds the index created. When the read alias exists
// without the write alias (deleted by hand, or lost during a reindex), it
// refuses with [ErrWriteAliasMissing]: after a reindex to "<alias>_v2",
// pointing the write alias at "<alias>_v1" again would send the writes to
// the old generation and make the read alias span two.
//
// The read alias is looked up before the write alias: both appear in one
// call and every later move changes both in one call, so a read alias seen
// first has its write alias by the second lookup, even when another
// indexer created them in between. (The other order saw "no write alias"
// before that indexer's create and "a read alias" after it, and refused.)
func Ensure(ctx context.Context, client *elastic.Client, alias, writeAlias string, mapping []byte) (string, error) {
	read, err := AliasTargets(ctx, client, alias)
	if err != nil {
		return "", err
	}
	targets, err := AliasTargets(ctx, client, writeAlias)
	if err != nil {
		return "", err
	}
	if len(targets) == 1 {
		return targets[0], nil
	}
	if len(targets) > 1 {
		return "", fmt.Errorf("write alias %s points at %d indices %v; want one", writeAlias, len(targets), targets)
	}
	if len(read) > 0 {
		return "", writeAliasMissing(alias, writeAlias, read)
	}
	index := alias + "_v1"
	if err := Create(ctx, client, index, mapping, map[string]any{
		alias:      map[string]any{"filter": notDeletedFilter},
		writeAlias: map[string]any{"is_write_index": true},
	}); err != nil {
		return "", err
	}
	return index, nil
}

func writeAliasMissing(alias, writeAlias string, read []string) error {
	slices.Sort(read)
	fix := fmt.Sprintf("pick the index the writes belong to (the read alias's, unless a reindex was under way) and run: "+
		`POST /_aliases {"actions":[{"add":{"index":"<index>","alias":%q,"is_write_index":true}}]}`, writeAlias)
	if len(read) == 1 {
		fix = fmt.Sprintf("if %s is the index the writes belong to, run: "+
			`POST /_aliases {"actions":[{"add":{"index":%q,"alias":%q,"is_write_index":true}}]}`, read[0], read[0], writeAlias)
	}
	return fmt.Errorf("%w: read alias %s points at %v but write alias %s does not exist; refusing to create or guess it (%s)",
		ErrWriteAliasMissing, alias, read, writeAlias, fix)
}

// Create creates index from a create-index body (settings, mappings)
// plus aliases, with FieldDeletedAt mapped as a date when the body does
// not map it (a strict mapping would refuse every tombstone otherwise). An index that already exists is not an error; its aliases
// are then added in one _aliases call.
func Create(ctx context.Context, client *elastic.Client, index string, mapping []byte, aliases map[string]any) error {
	var body map[string]any
	if err := json.Unmarshal(mapping, &body); err != nil {
		return fmt.Errorf("index mapping is not a JSON object: %w", err)
	}
	withDeletedAt(body)
	if len(aliases) > 0 {
		body["aliases"] = aliases
	}
	_, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method: http.MethodPut,
		Path:   "/" + url.PathEscape(index),
		Body:   body,
	})
	var ee *elastic.Error
	if errors.As(err, &ee) && ee.Details != nil && ee.Details.Type == "resource_already_exists_exception" {
		var actions []any
		for name, spec := range aliases {
			a := map[string]any{"index": index, "alias": name}
			for k, v := range spec.(map[string]any) {
				a[k] = v
			}
			actions = append(actions, map[string]any{"add": a})
		}
		if len(actions) == 0 {
			return nil
		}
		return UpdateAliases(ctx, client, actions)
	}
	if err != nil {
		return fmt.Errorf("create index %s: %w", index, err)
	}
	return nil
}

func UpdateAliases(ctx context.Context, client *elastic.Client, actions []any) error {
	_, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method: http.MethodPost,
		Path:   "/_aliases",
		Body:   map[string]any{"actions": actions},
	})
	if err != nil {
		return fmt.Errorf("update aliases: %w", err)
	}
	return nil
}

func Refresh(ctx context.Context, client *elastic.Client, index string) error {
	_, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodPost, Path: "/" + url.PathEscape(index) + "/_refresh"})
	if err != nil {
		return fmt.Errorf("refresh %s: %w", index, err)
	}
	return nil
}

func DeletedAtMapping() map[string]any {
	return map[string]any{"type": "date", "format": "epoch_millis"}
}

// withDeletedAt adds FieldDeletedAt to the mappings of a create-index body
// that does not map it.
func withDeletedAt(body map[string]any) {
	mappings, ok := body["mappings"].(map[string]any)
	if !ok {
		if body["mappings"] != nil {
			return // a shape this code does not know (e.g. typed mappings): left as it is
		}
		mappings = map[string]any{}
		body["mappings"] = mappings
	}
	props, ok := mappings["properties"].(map[string]any)
	if !ok {
		if mappings["properties"] != nil {
			return
		}
		props = map[string]any{}
		mappings["properties"] = props
	}
	if _, mapped := props[FieldDeletedAt]; !mapped {
		props[FieldDeletedAt] = DeletedAtMapping()
	}
}
