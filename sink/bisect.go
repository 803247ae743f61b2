package sink

import (
	"context"
	"errors"
	"net/http"

	"github.com/olivere/elastic/v7"
)

// bulkPart is a run of a batch's documents with the engine's answer to
// them: one result per document, or err when the request as a whole
// failed.
type bulkPart struct {
	docs    []*doc
	results []bulkItemResult
	err     error
	// refused: a single document the engine refused as a whole request;
	// results holds it as a permanent item failure, cause the refusal.
	refused bool
	cause   error
}

// bulkBisect sends docs in one bulk request. The engine refuses a whole
// request for what one item in it can cause: OpenSearch answers 400 to a
// bulk with one _id longer than 512 bytes, and 413 to a body over
// http.max_content_length. Such a request is split in halves, each sent
// again, down to single documents; a single document refused that way
// comes back as a permanent item failure (dead-lettered) carrying the
// request's error, and the rest of the batch goes through. When every
// document of the batch is refused alone, the cause is not one bad item (a
// proxy or a setting refuses every request): the refusal is returned as
// the error, and nothing is dead-lettered. A batch of one document (a
// quiet topic) has no other document to tell the two apart: its 400 is the
// document's fault only when the engine itself gave it (an engine error
// body, not a proxy's page). (A 413 for each document alone is each
// document's own size: those are dead-lettered.)
func (ix *Indexer) bulkBisect(ctx context.Context, docs []*doc) []bulkPart {
	parts := ix.bisect(ctx, docs, nil)
	if len(parts) == len(docs) {
		all := true
		for _, p := range parts {
			all = all && p.refused && elastic.IsStatusCode(p.cause, http.StatusBadRequest)
		}
		if all && (len(docs) > 1 || !fromEngine(parts[0].cause)) {
			return []bulkPart{{docs: docs, err: parts[0].cause}}
		}
	}
	return parts
}

// fromEngine reports whether a request-level error carries the engine's
// own error body.
func fromEngine(err error) bool {
	var ee *elastic.Error
	return errors.As(err, &ee) && ee.Details != nil && ee.Details.Type != ""
}

func (ix *Indexer) bisect(ctx context.Context, docs []*doc, parts []bulkPart) []bulkPart {
	results, err := ix.bulk(ctx, docs)
	if err == nil || !oneItemCanCause(err) {
		return append(parts, bulkPart{docs: docs, results: results, err: err})
	}
	if len(docs) == 1 {
		return append(parts, bulkPart{docs: docs, results: []bulkItemResult{refusedItem(err)}, refused: true, cause: err})
	}
	ix.m.retries.WithLabelValues(retryBisect).Add(float64(len(docs)))
	half := len(docs) / 2
	parts = ix.bisect(ctx, docs[:half], parts)
	return ix.bisect(ctx, docs[half:], parts)
}

// oneItemCanCause reports whether a request-level refusal may be one
// item's fault.
func oneItemCanCause(err error) bool {
	return elastic.IsStatusCode(err, http.StatusBadRequest) || elastic.IsStatusCode(err, http.StatusRequestEntityTooLarge)
}

// refusedItem is the item result of a document the engine refused as a
// whole request.
func refusedItem(err error) bulkItemResult {
	r := bulkItemResult{Status: http.StatusBadRequest, Error: &bulkItemError{Type: "http_400", Reason: err.Error()}}
	var ee *elastic.Error
	if errors.As(err, &ee) {
		r.Status = ee.Status
		if ee.Details != nil {
			r.Error = &bulkItemError{Type: ee.Details.Type, Reason: ee.Details.Reason}
		}
	}
	if r.Status == http.StatusRequestEntityTooLarge {
		r.Error = &bulkItemError{Type: CodeDocumentTooLarge, Reason: "the engine refused the request as too large"}
	}
	return r
}
