package bench_peers

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/internal/testproc"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// pollEvery is how often the search engine is asked what became searchable;
// it bounds the resolution of every latency and time-to-searchable figure.
const pollEvery = 20 * time.Millisecond

// writer changes single rows of source_records at a fixed rate, one
// transaction each, stamping each change with a number ("mark") that the
// document carries, and watches the index for the marks: commit→searchable.
type writer struct {
	pool      *pgxpool.Pool
	maxGroup  int    // rows are g = 1..maxGroup, id 3g+g%2 (demo.Seed)
	search    string // search engine URL
	index     string // index or alias searched
	markField string // the document field holding the mark
	update    string // $1 = id, $2 = mark; RETURNING the row's new version
	next      int64  // rows used so far, so each leg changes other rows
	// deleted counts the rows the deletes legs deleted: they run one after
	// the other, after every other leg, and each row can be deleted once,
	// so together they must not wrap around the table (row).
	deleted int64
	// idOf is the id of the row the writer changes for g (1..maxGroup);
	// nil: source_records' 3g+g%2 (demo.Seed).
	idOf func(g int64) int64
	// onTopic, when set, tells when a mark first arrived on the topic
	// (topicWatch): the legs then report commit → on the topic too.
	onTopic func(mark int64) (time.Time, bool)
}

// enqueueFunc writes the application's event inside the writer's transaction.
type enqueueFunc func(ctx context.Context, tx pgx.Tx, id, version, mark int64) error

// enqueue is outbox.Enqueue of the changed row's document, as an
// application writes it in its own transaction.
func enqueue(topic string) enqueueFunc {
	return func(ctx context.Context, tx pgx.Tx, id, version, mark int64) error {
		sid := strconv.FormatInt(id, 10)
		doc, err := json.Marshal(map[string]any{"id": id, "title": "Record " + sid + " changed", "mark": mark})
		if err != nil {
			return err
		}
		_, err = outbox.Enqueue(ctx, tx, outbox.Event{ID: outbox.EventID("source_records", sid, version, "bench-peers"), Topic: topic,
			AggregateType: "source_records", AggregateID: sid, AggregateVersion: version, Payload: doc})
		return err
	}
}

// warmUp waits until one change reaches the index, so a daemon's start is
// not counted in the first rate's latencies.
func (w *writer) warmUp(b testing.TB, procs ...*testproc.Proc) {
	l := w.runN(b, 1, 1, 10*time.Minute, 1, nil, procs...)
	if l.Lost > 0 {
		b.Fatalf("warm-up change did not reach %s within 10 minutes", w.index)
	}
}

// run writes rate changes/s for d, waits for them to become searchable (at
// most a minute after the last commit) and returns the latencies.
func (w *writer) run(b testing.TB, rate int, d time.Duration, base int64, enq enqueueFunc, procs ...*testproc.Proc) leg {
	n := max(1, int(float64(rate)*d.Seconds()))
	s0, _ := indexStats(w.search, w.index)
	t0 := time.Now()
	l := w.runN(b, rate, n, time.Minute, base, enq, procs...)
	if s1, err := indexStats(w.search, w.index); err == nil && s1.Refresh.Total > s0.Refresh.Total {
		refreshes := s1.Refresh.Total - s0.Refresh.Total
		b.Logf("%s at %d/s: %d refreshes in %.1f s, %.0f ms each on average; %d merges, %.1f s", w.index, rate, refreshes, time.Since(t0).Seconds(),
			float64(s1.Refresh.Millis-s0.Refresh.Millis)/float64(refreshes), s1.Merges.Total-s0.Merges.Total, float64(s1.Merges.Millis-s0.Merges.Millis)/1000)
	}
	b.Logf("%s at %d/s: %d changes (achieved %.0f/s), p50 %.0f ms, p99 %.0f ms, max %.0f ms, %d not searchable",
		w.index, rate, l.Events, l.Achieved, l.P50ms, l.P99ms, l.MaxMs, l.Lost)
	if l.TopicP99ms > 0 {
		b.Logf("%s at %d/s: commit → on the topic p50 %.0f ms, p99 %.0f ms", w.index, rate, l.TopicP50ms, l.TopicP99ms)
	}
	return l
}

// openLoop runs do(i) for i in [0, n) at rate/s on up to 32 connections of
// their own: change i is due at start + i/rate whatever happened before
// (open loop). The k-th change is of row id(k) (the first one after the
// rows of earlier legs); commits[i] is when do(i) returned, and done(i),
// when not nil, is then called. written is closed when every change
// returned; errs gets the first error.
type openLoop struct {
	start    time.Time
	interval time.Duration
	written  chan struct{}
	errs     chan error
	pool     *pgxpool.Pool
}

func (w *writer) openLoop(b testing.TB, rate, n int, commits []time.Time, do func(ctx context.Context, pool *pgxpool.Pool, i int, id int64) error, done func(i int)) *openLoop {
	ctx := context.Background()
	workers := min(32, max(2, rate/150))
	cfg, err := pgxpool.ParseConfig(w.pool.Config().ConnString())
	check(b, err)
	cfg.MaxConns = int32(workers)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	check(b, err)

	first := w.next
	w.next += int64(n)
	ol := &openLoop{interval: time.Second / time.Duration(rate), written: make(chan struct{}), errs: make(chan error, workers), pool: pool}
	var k atomic.Int64
	k.Store(-1)
	var wg sync.WaitGroup
	ol.start = time.Now()
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			timer := time.NewTimer(0)
			defer timer.Stop()
			for {
				i := k.Add(1)
				if i >= int64(n) {
					return
				}
				// Open loop: each change has its slot; a late writer does not
				// push the schedule back.
				timer.Reset(time.Until(ol.start.Add(time.Duration(i) * ol.interval)))
				<-timer.C
				g := row(first+i, int64(w.maxGroup))
				id := g*3 + g%2
				if w.idOf != nil {
					id = w.idOf(g)
				}
				if err := do(ctx, pool, int(i), id); err != nil {
					ol.errs <- fmt.Errorf("change row %d: %w", id, err)
					return
				}
				commits[i] = time.Now()
				if done != nil {
					done(int(i))
				}
			}
		}()
	}
	go func() { wg.Wait(); close(ol.written) }()
	return ol
}

// result is the leg of n changes whose commits returned at commits and
// whose search results showed them at seen (zero: never).
func (ol *openLoop) result(rate, n int, commits, seen []time.Time) leg {
	l := leg{Rate: rate, Events: n}
	var last time.Time
	for i := range n {
		last = maxTime(last, commits[i])
		if seen[i].IsZero() {
			l.Lost++
			continue
		}
		// A change can show in searches a little before Commit returns
		// to this writer: that is 0 ms, not a negative latency.
		l.latencies = append(l.latencies, max(0, float64(seen[i].Sub(commits[i]).Microseconds())/1000))
	}
	l.Achieved = float64(n) / max(last.Sub(ol.start).Seconds(), ol.interval.Seconds())
	slices.Sort(l.latencies)
	if len(l.latencies) > 0 { // else 0: JSON has no NaN, and the tables say "none"
		l.P50ms, l.P99ms, l.MaxMs = quantile(l.latencies, 0.50), quantile(l.latencies, 0.99), quantile(l.latencies, 1)
	}
	return l
}

func (w *writer) runN(b testing.TB, rate, n int, grace time.Duration, base int64, enq enqueueFunc, procs ...*testproc.Proc) leg {
	ctx := context.Background()
	commits, seen := make([]time.Time, n), make([]time.Time, n)
	ol := w.openLoop(b, rate, n, commits, func(ctx context.Context, pool *pgxpool.Pool, i int, id int64) error {
		return w.change(ctx, pool, id, base+int64(i), enq)
	}, nil)
	defer ol.pool.Close()
	errs, written := ol.errs, ol.written

	// Watch for the marks [base, base+n) while they are written.
	var writeEnd time.Time
	lowest, nseen := 0, 0
	tick := time.NewTicker(pollEvery)
	defer tick.Stop()
	var deadline time.Time
	for nseen < n {
		select {
		case err := <-errs:
			b.Fatal(err)
		case <-written:
			written = nil
			writeEnd = time.Now()
			deadline = writeEnd.Add(grace)
		case <-tick.C:
		}
		if !deadline.IsZero() && time.Now().After(deadline) {
			break
		}
		for _, p := range procs {
			select {
			case <-p.Done():
				b.Fatalf("%s exited %d\n%s", filepath.Base(p.Cmd.Path), p.ExitCode(), lastLines(p.Stderr(), 30))
			default:
			}
		}
		marks, err := w.searchMarks(ctx, base+int64(lowest), base+int64(n))
		if err != nil {
			continue // the index may not exist yet
		}
		now := time.Now()
		for _, m := range marks {
			i := int(m - base)
			if i >= 0 && i < n && seen[i].IsZero() {
				seen[i] = now
				nseen++
			}
		}
		for lowest < n && !seen[lowest].IsZero() {
			lowest++
		}
	}
	if writeEnd.IsZero() {
		<-written // the writer must be done before its commit times are read
	}
	l := ol.result(rate, n, commits, seen)
	if w.onTopic != nil {
		var lat []float64
		for i := range n {
			if t, ok := w.onTopic(base + int64(i)); ok && !commits[i].IsZero() {
				lat = append(lat, max(0, float64(t.Sub(commits[i]).Microseconds())/1000))
			}
		}
		slices.Sort(lat)
		if len(lat) > 0 {
			l.TopicP50ms, l.TopicP99ms = quantile(lat, 0.50), quantile(lat, 0.99)
		}
	}
	return l
}

// deletes hard-deletes rate rows/s for d, one DELETE per transaction (rows
// no earlier leg deleted), and waits until a search no longer returns them
// (at most a minute after the last commit): commit→gone from searches. A
// search asks every pollEvery which of the committed deletes not yet gone
// are still visible (an ids query over them).
func (w *writer) deletes(b testing.TB, rate int, d time.Duration, procs ...*testproc.Proc) leg {
	ctx := context.Background()
	n := max(1, int(float64(rate)*d.Seconds()))
	w.deleted += int64(n)
	if valid := int64(w.maxGroup - w.maxGroup/badEvery); w.deleted > valid {
		b.Fatalf("the deletes legs need %d rows, more than the %d valid rows: raise BENCH_PEERS_ROWS or shorten BENCH_PEERS_LEG", w.deleted, valid)
	}
	commits, seen := make([]time.Time, n), make([]time.Time, n)
	ids := make([]string, n)
	// Each delete's index once its commit returned: only then does its
	// absence from searches measure its latency (before, the document is
	// there anyway).
	committed := make(chan int, n)
	ol := w.openLoop(b, rate, n, commits, func(ctx context.Context, pool *pgxpool.Pool, i int, id int64) error {
		ids[i] = strconv.FormatInt(id, 10)
		tag, err := pool.Exec(ctx, `DELETE FROM source_records WHERE id = $1`, id)
		if err == nil && tag.RowsAffected() != 1 {
			err = fmt.Errorf("DELETE deleted %d rows, want 1", tag.RowsAffected())
		}
		return err
	}, func(i int) { committed <- i })
	defer ol.pool.Close()
	errs, written := ol.errs, ol.written

	pending := map[string]int{} // _id → index of its delete
	gone := 0
	var writeEnd, deadline time.Time
	tick := time.NewTicker(pollEvery)
	defer tick.Stop()
	for gone < n {
		select {
		case err := <-errs:
			b.Fatal(err)
		case <-written:
			written = nil
			writeEnd = time.Now()
			deadline = writeEnd.Add(time.Minute)
		case <-tick.C:
		}
		if !deadline.IsZero() && time.Now().After(deadline) {
			break
		}
		for _, p := range procs {
			select {
			case <-p.Done():
				b.Fatalf("%s exited %d\n%s", filepath.Base(p.Cmd.Path), p.ExitCode(), lastLines(p.Stderr(), 30))
			default:
			}
		}
		for more := true; more; {
			select {
			case i := <-committed:
				pending[ids[i]] = i
			default:
				more = false
			}
		}
		if len(pending) == 0 {
			continue
		}
		asked := make([]string, 0, min(len(pending), 10_000))
		for id := range pending {
			if len(asked) == 10_000 { // the engine's largest page
				break
			}
			asked = append(asked, id)
		}
		visible, err := w.searchIDs(ctx, asked)
		if err != nil {
			continue
		}
		now := time.Now()
		for _, id := range asked {
			if !visible[id] {
				seen[pending[id]] = now
				delete(pending, id)
				gone++
			}
		}
	}
	if writeEnd.IsZero() {
		<-written // the writer must be done before its commit times are read
	}
	l := ol.result(rate, n, commits, seen)
	b.Logf("%s: %d hard deletes at %d/s (achieved %.0f/s), commit→gone from searches p50 %.0f ms, p99 %.0f ms, max %.0f ms, %d still searchable",
		w.index, l.Events, rate, l.Achieved, l.P50ms, l.P99ms, l.MaxMs, l.Lost)
	return l
}

// searchIDs returns which of ids a search finds now. An answer that timed
// out or lost a shard is an error: a missing hit must mean the document is
// not searchable.
func (w *writer) searchIDs(ctx context.Context, ids []string) (map[string]bool, error) {
	body := map[string]any{"size": len(ids), "_source": false, "query": map[string]any{"ids": map[string]any{"values": ids}}}
	var res struct {
		TimedOut bool `json:"timed_out"`
		Shards   struct {
			Failed int `json:"failed"`
		} `json:"_shards"`
		Hits struct {
			Hits []struct {
				ID string `json:"_id"`
			} `json:"hits"`
		} `json:"hits"`
	}
	if err := searchPost(ctx, w.search, "/"+url.PathEscape(w.index)+"/_search", body, &res); err != nil {
		return nil, err
	}
	if res.TimedOut || res.Shards.Failed > 0 {
		return nil, fmt.Errorf("search of %d ids: timed out %v, %d shards failed", len(ids), res.TimedOut, res.Shards.Failed)
	}
	visible := make(map[string]bool, len(res.Hits.Hits))
	for _, h := range res.Hits.Hits {
		visible[h.ID] = true
	}
	return visible, nil
}

// badEvery is the seed's demo.SeedOptions.BadEvery: every badEvery-th row
// has no title, which the demo normalizer quarantines.
const badEvery = 10_000

// row is the k-th row a writer changes: g in 1..maxGroup, never a row the
// normalizer quarantines (its change would never be searchable through the
// batcher), spread over the table, and all different for k < the number of
// valid rows.
func row(k, maxGroup int64) int64 {
	valid := maxGroup - maxGroup/badEvery
	stride := int64(7919) // prime: coprime with valid unless it divides it
	if valid%stride == 0 {
		stride = 1
	}
	j := k * stride % valid
	return j + j/(badEvery-1) + 1
}

// change is one transaction: the row's UPDATE and, for outboxrelay, its event.
func (w *writer) change(ctx context.Context, pool *pgxpool.Pool, id, mark int64, enq enqueueFunc) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	var version int64
	if err := tx.QueryRow(ctx, w.update, id, mark).Scan(&version); err != nil {
		return err
	}
	if enq != nil {
		if err := enq(ctx, tx, id, version, mark); err != nil {
			return err
		}
	}
	return tx.Commit(ctx)
}

// searchMarks returns the marks in [from, to) that a search finds now (the
// lowest 10,000 of them).
func (w *writer) searchMarks(ctx context.Context, from, to int64) ([]int64, error) {
	body := map[string]any{
		"size": 10_000, "_source": []string{w.markField},
		"query": map[string]any{"range": map[string]any{w.markField: map[string]any{"gte": from, "lt": to}}},
		"sort":  []any{map[string]any{w.markField: "asc"}},
	}
	var res struct {
		Hits struct {
			Hits []struct {
				Sort []json.Number `json:"sort"`
			} `json:"hits"`
		} `json:"hits"`
	}
	if err := searchPost(ctx, w.search, "/"+url.PathEscape(w.index)+"/_search", body, &res); err != nil {
		return nil, err
	}
	out := make([]int64, 0, len(res.Hits.Hits))
	for _, h := range res.Hits.Hits {
		if len(h.Sort) == 1 {
			if m, err := h.Sort[0].Int64(); err == nil {
				out = append(out, m)
			}
		}
	}
	return out, nil
}

// waitCount waits until index counts want documents (searchable, no forced
// refresh), failing when failed reports a reason or after timeout; it
// returns the time since start.
func waitCount(b testing.TB, search, index string, want int64, timeout time.Duration, failed func() string, start time.Time) time.Duration {
	ctx := context.Background()
	tick := time.NewTicker(pollEvery * 5)
	defer tick.Stop()
	var last int64
	for range tick.C {
		var res struct {
			Count int64 `json:"count"`
		}
		if err := searchPost(ctx, search, "/"+url.PathEscape(index)+"/_count", nil, &res); err == nil {
			last = res.Count
			if res.Count >= want {
				return time.Since(start)
			}
		}
		if msg := failed(); msg != "" {
			b.Fatalf("%s: %d of %d documents searchable: %s", index, last, want, msg)
		}
		if time.Since(start) > timeout {
			b.Fatalf("%s: %d of %d documents searchable after %s", index, last, want, timeout)
		}
	}
	panic("unreachable")
}

var httpClient = &http.Client{Timeout: 30 * time.Second}

func searchPost(ctx context.Context, base, path string, body, out any) error {
	var rd *bytes.Reader
	if body == nil {
		rd = bytes.NewReader(nil)
	} else {
		raw, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(raw)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(base, "/")+path, rd)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := httpClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("POST %s: %s", path, resp.Status)
	}
	dec := json.NewDecoder(resp.Body)
	dec.UseNumber()
	return dec.Decode(out)
}

func deleteIndex(search, index string) {
	req, err := http.NewRequest(http.MethodDelete, strings.TrimRight(search, "/")+"/"+url.PathEscape(index), nil)
	if err != nil {
		return
	}
	if resp, err := httpClient.Do(req); err == nil {
		resp.Body.Close()
	}
}

// startRedis runs a private redis-server (no persistence) on a free port
// for PGSync's change queue; it stops when the benchmark ends.
func startRedis(b testing.TB, bin, dir string) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	check(b, err)
	addr := l.Addr().String()
	check(b, l.Close())
	_, port, _ := strings.Cut(addr, ":")
	rdir := filepath.Join(dir, "redis")
	check(b, os.MkdirAll(rdir, 0o755))
	p := testproc.Start(b, bin, nil, "--bind", "127.0.0.1", "--port", port, "--save", "", "--appendonly", "no", "--dir", rdir)
	deadline := time.Now().Add(time.Minute)
	for {
		if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
			c.Close()
			return addr
		}
		select {
		case <-p.Done():
			b.Fatalf("redis-server exited %d\n%s%s", p.ExitCode(), p.Stdout(), p.Stderr())
		case <-time.After(pollEvery * 5):
		}
		if time.Now().After(deadline) {
			b.Fatal("redis-server did not listen within a minute")
		}
	}
}

func hostPort(b testing.TB, dbURL string) (string, string) {
	u, err := url.Parse(dbURL)
	check(b, err)
	return u.Hostname(), u.Port()
}

// processCPU is the user+system time of a running process and of its
// children that ended, from /proc (0 when it is gone).
func processCPU(p *testproc.Proc) time.Duration {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.Cmd.Process.Pid))
	if err != nil {
		return 0
	}
	s := string(raw)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	var ticks int64
	for _, i := range []int{11, 12, 13, 14} { // utime stime cutime cstime (fields 14-17)
		if i < len(f) {
			n, _ := strconv.ParseInt(f[i], 10, 64)
			ticks += n
		}
	}
	return time.Duration(ticks) * 10 * time.Millisecond
}

func quantile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	return sorted[max(0, int(math.Ceil(q*float64(len(sorted))))-1)]
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
