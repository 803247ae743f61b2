package sink

import (
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"time"
	"unsafe"

	"github.com/olivere/elastic/v7"
)

// DefaultMapping is the create-index body used when none is configured:
// one shard, dynamic mapping, and the tombstone marker field.
//
//go:embed mapping.json
var DefaultMapping []byte

// retryableItemTypes are bulk item error types worth sending again even
// when their status alone would not say so.
var retryableItemTypes = map[string]bool{
	"es_rejected_execution_exception":         true,
	"cluster_block_exception":                 true, // read-only index (disk watermark): heals when an operator frees space
	"index_not_found_exception":               true, // the write alias is missing (require_alias): heals when it comes back
	"unavailable_shards_exception":            true,
	"circuit_breaking_exception":              true,
	"process_cluster_event_timeout_exception": true,
}

type itemOutcome int

const (
	outcomeIndexed itemOutcome = iota
	outcomeConflict
	outcomeRetry
	outcomePermanent
)

type bulkItemResult struct {
	Status int            `json:"status"`
	Error  *bulkItemError `json:"error"`
}

type bulkItemError struct {
	Type   string `json:"type"`
	Reason string `json:"reason"`
}

func (r bulkItemResult) outcome() itemOutcome {
	switch {
	case r.Status >= 200 && r.Status < 300:
		return outcomeIndexed
	case r.Status == http.StatusConflict:
		return outcomeConflict
	case r.Status == http.StatusTooManyRequests || r.Status >= 500:
		return outcomeRetry
	case r.Error != nil && retryableItemTypes[r.Error.Type]:
		return outcomeRetry
	default:
		return outcomePermanent
	}
}

func (r bulkItemResult) itemError() *itemError {
	e := &itemError{Status: r.Status, Code: "http_" + strconv.Itoa(r.Status)}
	if r.Error != nil {
		e.Code, e.Reason = r.Error.Type, r.Error.Reason
	}
	return e
}

type bulkResponse struct {
	Errors bool       `json:"errors"`
	Items  []bulkItem `json:"items"`
}

// bulkItem is one item of a bulk answer, keyed by its action: the indexer
// only sends index actions. (A struct, not a map per item: decoding the
// answers is a good part of the indexer's own CPU time.)
type bulkItem struct {
	Index bulkItemResult `json:"index"`
}

var bulkParams = url.Values{
	// A missing write alias must fail the items, not auto-create an index
	// named like the alias.
	"require_alias": {"true"},
	"filter_path":   {"errors,items.*.status,items.*.error.type,items.*.error.reason"},
}

// bulkHeaders turn off the compression of bulk answers, which the HTTP
// client asks for by default: an answer is a few bytes per item, against
// hundreds per item in the request (never compressed), and compressing it
// costs the engine CPU time it would rather spend indexing.
var bulkHeaders = http.Header{"Accept-Encoding": {"identity"}}

// appendBulk appends one externally versioned index action and its body,
// to the document's target alias.
func appendBulk(buf *bytes.Buffer, d *doc) {
	buf.WriteString(`{"index":{"_index":`)
	appendJSONString(buf, d.target)
	buf.WriteString(`,"_id":`)
	appendJSONString(buf, d.id)
	buf.WriteString(`,"version":`)
	buf.WriteString(strconv.FormatInt(d.version, 10))
	if d.versionFromIndex {
		buf.WriteString(`,"version_type":"external_gte"}}` + "\n")
	} else {
		buf.WriteString(`,"version_type":"external"}}` + "\n")
	}
	buf.Write(appendDocument(buf.AvailableBuffer(), d))
	buf.WriteByte('\n')
}

func appendJSONString(buf *bytes.Buffer, s string) {
	plain := true
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x7f || c == '"' || c == '\\' {
			plain = false
			break
		}
	}
	if plain {
		buf.WriteByte('"')
		buf.WriteString(s)
		buf.WriteByte('"')
		return
	}
	b, _ := json.Marshal(s) // a Go string always marshals
	buf.Write(b)
}

// sendBulk sends docs in one bulk request and returns one result per doc,
// in order, and the size of the request body. An error means no item
// result is known.
func sendBulk(ctx context.Context, client *elastic.Client, docs []*doc) ([]bulkItemResult, int, error) {
	// A body of its own for every request, allocated at about its final
	// size: growing one from nothing by doubling was a sixth of the
	// indexer's CPU in a first load's profile, with the copy into a string
	// below. Nothing writes it once it is sent, so handing it over without
	// that copy is safe even when the transport still writes it to a
	// connection it is closing after an early answer (net/http may, after
	// RoundTrip returned).
	buf := bytes.NewBuffer(make([]byte, 0, bulkBodySize(docs)))
	for _, d := range docs {
		appendBulk(buf, d)
	}
	size := buf.Len()
	res, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method:      http.MethodPost,
		Path:        "/_bulk",
		Params:      bulkParams,
		Headers:     bulkHeaders,
		Body:        bodyString(buf.Bytes()),
		ContentType: "application/x-ndjson",
	})
	if err != nil {
		return nil, size, err
	}
	var br bulkResponse
	if err := json.Unmarshal(res.Body, &br); err != nil {
		return nil, size, fmt.Errorf("decode bulk response: %w", err)
	}
	out := make([]bulkItemResult, len(docs))
	if len(br.Items) != len(docs) {
		return nil, size, fmt.Errorf("bulk response has %d items for %d actions", len(br.Items), len(docs))
	}
	for i, it := range br.Items {
		out[i] = it.Index
	}
	return out, size, nil
}

// bulkBodySize is at least what appendBulk writes for docs, unless a string
// in it needs escaping (more only costs the buffer a copy): the action line
// (its fixed part at most 93 bytes, with external_gte) and the document
// with the fields added to it (at most 166 bytes beside the processor
// version and the aggregate type, with a tombstone's _deleted_at and a
// three-number _pos).
func bulkBodySize(docs []*doc) int {
	n := 0
	for _, d := range docs {
		n += len(d.target) + len(d.id) + len(d.body) + len(d.pv) + len(d.aggType) + 260
	}
	return n
}

// bodyString returns b as a string without copying it: the client takes a
// request body as a string only, and a bulk body is megabytes. The caller
// never writes b again.
func bodyString(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	return unsafe.String(unsafe.SliceData(b), len(b))
}

// pingTimeout bounds the readiness check.
const pingTimeout = 2 * time.Second

func ping(ctx context.Context, client *elastic.Client) error {
	ctx, cancel := context.WithTimeout(ctx, pingTimeout)
	defer cancel()
	_, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodGet, Path: "/"})
	return err
}
