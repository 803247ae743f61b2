package batch

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxrelay/outboxrelay/internal/jsonvalid"
)

// goChunk is the custom Processor path: read the range (a.Cursor,
// a.Boundary], or the rows a.IDs, process in Go, write back with unnest
// arrays. It returns the ids written (the rows not quarantined).
func (r *Runner) goChunk(ctx context.Context, tx pgx.Tx, a *args, res *chunkResult, fresh bool) ([]string, error) {
	cursor := a.Cursor
	st := r.c.fetchNext
	switch {
	case a.IDs != nil:
		st = r.c.fetchIDs
	case cursor == nil:
		st = r.c.fetchFirst
	}
	t0 := time.Now()
	rows, err := tx.Query(ctx, st.sql, st.bind(a)...)
	if err != nil {
		return nil, fmt.Errorf("fetch chunk after %v: %w", cursor, err)
	}
	var src []SourceRow
	for rows.Next() {
		var sr SourceRow
		var row []byte
		if err := rows.Scan(&sr.ID, &sr.Version, &sr.Deleted, &res.next, &row); err != nil {
			rows.Close()
			return nil, fmt.Errorf("fetch chunk: %w", err)
		}
		sr.Row = row
		src = append(src, sr)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("fetch chunk after %v: %w", cursor, err)
	}
	res.n = len(src)
	res.fetch = time.Since(t0)
	r.cfg.Metrics.inflight(r.spec.Job, len(src))
	defer r.cfg.Metrics.inflight(r.spec.Job, -len(src))
	if len(src) == 0 {
		return nil, nil
	}
	// Process in slices and write each slice as soon as it is ready, so the
	// processor works on slice k+1 while the server writes slice k. All
	// writes are in the chunk's transaction: a later error rolls back all.
	pctx, cancel := context.WithCancel(ctx)
	parts := make(chan goPart, 1)
	go func() {
		defer close(parts)
		for lo := 0; lo < len(src); lo += goWriteSlice {
			t := time.Now()
			p := r.goProcess(pctx, src[lo:min(lo+goWriteSlice, len(src))])
			p.took = time.Since(t)
			select {
			case parts <- p:
			case <-pctx.Done():
				return
			}
			if p.err != nil {
				return
			}
		}
	}()
	defer func() {
		cancel()
		for range parts { // let the producer finish
		}
	}()
	var good []string
	for p := range parts {
		res.proc += p.took
		if p.err != nil {
			return nil, p.err
		}
		t := time.Now()
		var changed int64
		w := *a
		w.IDs, w.Vers, w.Dels, w.Docs = p.ids, p.vers, p.dels, p.docs
		write := r.c.write
		if fresh {
			write = r.c.writeFresh
		}
		if err := tx.QueryRow(ctx, write.sql, write.bind(&w)...).Scan(&changed); err != nil {
			return nil, fmt.Errorf("upsert normalized records and outbox events: %w", err)
		}
		res.changed += changed
		if len(p.badIDs) > 0 {
			q := *a
			q.IDs, q.Codes, q.Msgs = p.badIDs, p.codes, p.msgs
			if _, err := tx.Exec(ctx, r.c.quarantine.sql, r.c.quarantine.bind(&q)...); err != nil {
				return nil, fmt.Errorf("quarantine %d rows: %w", len(p.badIDs), err)
			}
			res.bad += int64(len(p.badIDs))
		}
		good = append(good, p.ids...)
		res.write += time.Since(t)
	}
	return good, nil
}

// goWriteSlice is how many processed rows go into one unnest write. Smaller
// slices overlap the processor with the server's writes, which pays on
// machines with spare cores; on two busy cores it measured a wash, so only
// big chunks are split.
const goWriteSlice = 10000

// goPart is one processed slice of a chunk, ready to write.
type goPart struct {
	ids                 []string
	vers                []int64
	dels                []bool
	docs                [][]byte // nil: a delete
	badIDs, codes, msgs []string
	took                time.Duration
	err                 error
}

// goProcess runs the Processor over rows and applies the bad-row policy.
func (r *Runner) goProcess(ctx context.Context, src []SourceRow) goPart {
	results, err := processConcurrently(ctx, r.cfg.Processor, src, r.spec.Chunk.Concurrency)
	if err != nil {
		return goPart{err: fmt.Errorf("process chunk: %w", err)}
	}
	n := len(src)
	p := goPart{ids: make([]string, 0, n), vers: make([]int64, 0, n), dels: make([]bool, 0, n), docs: make([][]byte, 0, n)}
	// The documents are copied into one buffer: a processor may reuse its
	// own once Process has returned, while these wait for the write.
	size := 0
	for i := range results {
		size += len(results[i].Document)
	}
	buf := make([]byte, 0, size)
	bad := func(id, code, msg string) {
		p.badIDs, p.codes, p.msgs = append(p.badIDs, id), append(p.codes, code), append(p.msgs, msg)
	}
	for i, sr := range src {
		res := results[i]
		// What no event can carry (the outbox refuses it: an empty key, a
		// negative version), as the SQL path's chunk statement does.
		if code, msg := keyProblem(sr.ID, sr.Version); code != "" {
			if r.spec.Errors.Policy == PolicyQuarantine {
				bad(sr.ID, code, msg)
				continue
			}
			return goPart{err: &BadRowError{ID: sr.ID, Code: code, Message: msg}}
		}
		if !sr.Deleted && res.Err != nil {
			code := cmp.Or(res.Code, "processor_error")
			var te *transientError
			switch {
			case r.spec.Errors.Policy == PolicyQuarantine:
				bad(sr.ID, code, res.Err.Error())
				continue
			case r.spec.Errors.Policy == PolicyRetry && errors.As(res.Err, &te):
				return goPart{err: fmt.Errorf("row id=%s: %w", sr.ID, res.Err)}
			default:
				return goPart{err: &BadRowError{ID: sr.ID, Code: code, Message: res.Err.Error()}}
			}
		}
		var doc []byte
		if !sr.Deleted {
			if !jsonvalid.Valid(res.Document) {
				if r.spec.Errors.Policy == PolicyQuarantine {
					bad(sr.ID, "invalid_document", "processor returned invalid JSON")
					continue
				}
				return goPart{err: &BadRowError{ID: sr.ID, Code: "invalid_document", Message: "processor returned invalid JSON"}}
			}
			// The document of an upsert event is a JSON object (the outbox
			// refuses anything else: outbox_events_upsert_document).
			if !jsonObject(res.Document) {
				const msg = "processor returned JSON that is not an object (a document is a JSON object)"
				if r.spec.Errors.Policy == PolicyQuarantine {
					bad(sr.ID, "invalid_document", msg)
					continue
				}
				return goPart{err: &BadRowError{ID: sr.ID, Code: "invalid_document", Message: msg}}
			}
			buf = append(buf, res.Document...)
			doc = buf[len(buf)-len(res.Document) : len(buf) : len(buf)] // valid JSON is never empty, so never NULL
		}
		p.ids, p.vers, p.dels, p.docs = append(p.ids, sr.ID), append(p.vers, sr.Version), append(p.dels, sr.Deleted), append(p.docs, doc)
	}
	return p
}

// jsonObject reports whether doc (valid JSON) is an object.
func jsonObject(doc []byte) bool {
	for _, c := range doc {
		switch c {
		case ' ', '\t', '\n', '\r':
			continue
		}
		return c == '{'
	}
	return false
}

// keyProblem is why a row's id and version cannot be an event's key and
// version (the codes and messages of the SQL path's chunk statement).
func keyProblem(id string, version int64) (code, msg string) {
	switch {
	case id == "":
		return "invalid_id", "the id is empty: an event needs a key"
	case version < 0:
		return "invalid_version", fmt.Sprintf("the version %d is negative", version)
	}
	return "", ""
}
