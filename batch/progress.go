package batch

import (
	"context"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// progress prints one self-overwriting line on a terminal: processed /
// estimated, rate and ETA, at most twice a second.
type progress struct {
	w        io.Writer
	mu       sync.Mutex
	base     int64 // processed before this process started
	done     int64 // processed by this process
	estimate int64
	start    time.Time
	last     time.Time
}

func newProgress(w io.Writer) *progress { return &progress{w: w, start: time.Now()} }

func (p *progress) load(ctx context.Context, pool *pgxpool.Pool, job, run string) error {
	return pool.QueryRow(ctx, `SELECT COALESCE(sum(processed_count), 0), COALESCE(sum(COALESCE(estimated_total, 0)), 0) FROM batch_runs WHERE job = $1 AND logical_run_id = $2`, job, run).Scan(&p.base, &p.estimate)
}

func (p *progress) add(n int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done += n
	if time.Since(p.last) >= 500*time.Millisecond {
		p.print()
	}
}

func (p *progress) print() {
	p.last = time.Now()
	elapsed := time.Since(p.start).Seconds()
	rate := float64(p.done) / max(elapsed, 0.001)
	total := p.base + p.done
	line := fmt.Sprintf("\r%d", total)
	if p.estimate > 0 {
		eta := "-"
		if rate > 0 && p.estimate > total {
			eta = (time.Duration(float64(p.estimate-total)/rate) * time.Second).Round(time.Second).String()
		}
		line += fmt.Sprintf(" / ~%d rows (%.1f%%)  %.0f rows/s  ETA %s", p.estimate, 100*float64(total)/float64(p.estimate), rate, eta)
	} else {
		line += fmt.Sprintf(" rows  %.0f rows/s", rate)
	}
	fmt.Fprintf(p.w, "%-80s", line)
}

func (p *progress) finish() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.print()
	fmt.Fprintln(p.w)
}
