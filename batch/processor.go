package batch

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"sync"
)

// SourceRow is one source row as a custom [Processor] sees it.
type SourceRow struct {
	// ID is the row's id column as text (the aggregate id).
	ID string
	// Version is the row's version column.
	Version int64
	// Deleted is true for soft-deleted rows; they become delete events
	// whatever the processor returns.
	Deleted bool
	// Row is the whole row as a JSON object (to_jsonb).
	Row json.RawMessage
}

// Result is what a [Processor] makes of one row.
type Result struct {
	// Document is the normalized document (JSON). Ignored for deleted rows.
	Document json.RawMessage
	// Err, when set, makes the row bad: the job's policy decides (strict
	// fails the run, quarantine records it, retry retries it if it is
	// [Transient]). Code names the kind of error for the quarantine table.
	Err  error
	Code string
}

// Processor turns a chunk of source rows into documents: the Go path for
// normalization that SQL cannot express. It returns one Result per row, in
// order. An error fails the whole chunk (retried if [IsRetryable]).
// Process may be called from several goroutines at once: when
// chunk.concurrency > 1 (each call gets rows of distinct ids) and when
// chunk.pipeline > 1 (the next chunk is processed while the previous one
// is written; its rows come later in cursor order).
type Processor interface {
	Process(ctx context.Context, rows []SourceRow) ([]Result, error)
}

// ProcessorFunc adapts a function to [Processor].
type ProcessorFunc func(ctx context.Context, rows []SourceRow) ([]Result, error)

// Process calls f.
func (f ProcessorFunc) Process(ctx context.Context, rows []SourceRow) ([]Result, error) {
	return f(ctx, rows)
}

// processConcurrently splits rows by a hash of the id into n groups (rows of
// one id stay in one group, in order), runs the groups in parallel and puts
// the results back in row order.
func processConcurrently(ctx context.Context, p Processor, rows []SourceRow, n int) ([]Result, error) {
	if n <= 1 || len(rows) < 2 {
		return checkResults(p.Process(forCall(ctx, rows), rows))(len(rows))
	}
	groups := make([][]int, n)
	for i, r := range rows {
		h := fnv.New32a()
		h.Write([]byte(r.ID))
		g := int(h.Sum32() % uint32(n))
		groups[g] = append(groups[g], i)
	}
	out := make([]Result, len(rows))
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
	)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for _, idx := range groups {
		if len(idx) == 0 {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			sub := make([]SourceRow, len(idx))
			for i, j := range idx {
				sub[i] = rows[j]
			}
			res, err := checkResults(p.Process(forCall(ctx, sub), sub))(len(sub))
			if err != nil {
				mu.Lock()
				if firstErr == nil {
					firstErr = err
					cancel()
				}
				mu.Unlock()
				return
			}
			for i, j := range idx {
				out[j] = res[i]
			}
		}()
	}
	wg.Wait()
	return out, firstErr
}

func checkResults(res []Result, err error) func(int) ([]Result, error) {
	return func(n int) ([]Result, error) {
		if err != nil {
			return nil, err
		}
		if len(res) != n {
			return nil, fmt.Errorf("processor returned %d results for %d rows", len(res), n)
		}
		return res, nil
	}
}
