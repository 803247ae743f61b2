package bench_debezium

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxrelay/outboxrelay/internal/benchround"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// Result is one measured run, or (Round 0) the median of a peer's runs of
// one scenario. The JSON form is the contract with bench-peers: see
// README.md, "Results".
type Result struct {
	Peer     string `json:"peer"`     // "debezium", "debezium-poll-10ms" or "publisher"
	Scenario string `json:"scenario"` // "backlog" or "latency"
	Round    int    `json:"round"`    // 1.., or 0 for the median over the rounds
	Events   int    `json:"events"`   // events counted in the figures below

	// backlog: events waiting before the peer starts.
	EventsPerSec float64 `json:"events_per_s,omitempty"`        // Events / (last arrival − first arrival)
	SteadyPerSec float64 `json:"steady_events_per_s,omitempty"` // the middle 80% of the events / their arrival span
	StartupSec   float64 `json:"startup_s,omitempty"`           // peer start → first arrival
	TotalSec     float64 `json:"total_s,omitempty"`             // peer start → last arrival

	// latency: a writer commits events at a steady rate while the peer runs.
	OfferedPerSec  int     `json:"offered_per_s,omitempty"`  // the writer's target rate
	AchievedPerSec float64 `json:"achieved_per_s,omitempty"` // what it committed
	P50Ms          float64 `json:"p50_ms,omitempty"`         // commit → arrival at a Kafka consumer
	P99Ms          float64 `json:"p99_ms,omitempty"`
	MaxMs          float64 `json:"max_ms,omitempty"`

	Missing    int     `json:"missing"`    // events that never arrived (within the wait)
	Duplicates int     `json:"duplicates"` // events that arrived more than once
	PeerCPUSec float64 `json:"peer_cpu_s"` // the peer process's user+system CPU for the run
}

// Report is the file the benchmark writes.
type Report struct {
	Benchmark string            `json:"benchmark"` // "debezium-vs-publisher"
	Date      string            `json:"date"`      // RFC 3339, UTC
	Machine   map[string]string `json:"machine"`
	Versions  map[string]string `json:"versions"`
	Settings  map[string]any    `json:"settings"`
	Runs      []Result          `json:"runs"`
	Summary   []Result          `json:"summary"`
}

// settings of one benchmark run, from the environment (README.md).
type settings struct {
	scenarios []string
	backlog   int
	rates     []int
	seconds   time.Duration
	warmup    time.Duration
	peers     []string
	out       string
}

func readSettings(b *testing.B) settings {
	b.Helper()
	s := settings{
		scenarios: strings.Split(cmp.Or(os.Getenv("DEBEZIUM_BENCH_SCENARIOS"), "backlog,latency"), ","),
		peers:     strings.Split(cmp.Or(os.Getenv("DEBEZIUM_BENCH_PEERS"), "debezium,debezium-poll-10ms,publisher"), ","),
		out:       cmp.Or(os.Getenv("DEBEZIUM_BENCH_OUT"), filepath.Join(stack.RepoRoot(), "bench", "results", "debezium.json")),
	}
	var err error
	num := func(name, def string) int {
		if err != nil {
			return 0
		}
		var n int
		n, err = strconv.Atoi(cmp.Or(os.Getenv(name), def))
		if err == nil && n <= 0 {
			err = fmt.Errorf("%s %q: want a positive number", name, os.Getenv(name))
		}
		return n
	}
	s.backlog = num("DEBEZIUM_BENCH_EVENTS", "200000")
	s.seconds = time.Duration(num("DEBEZIUM_BENCH_SECONDS", "15")) * time.Second
	s.warmup = time.Duration(num("DEBEZIUM_BENCH_WARMUP", "5")) * time.Second
	for _, r := range strings.Split(cmp.Or(os.Getenv("DEBEZIUM_BENCH_RATES"), "1000,10000"), ",") {
		var n int
		if n, err = strconv.Atoi(strings.TrimSpace(r)); err == nil && n <= 0 {
			err = fmt.Errorf("DEBEZIUM_BENCH_RATES %q: want positive rates", r)
		}
		if err != nil {
			break
		}
		s.rates = append(s.rates, n)
	}
	if err != nil {
		b.Fatal(err)
	}
	for _, sc := range s.scenarios {
		if sc != "backlog" && sc != "latency" {
			b.Fatalf("DEBEZIUM_BENCH_SCENARIOS: %q is none of backlog, latency", sc)
		}
	}
	return s
}

// BenchmarkDebeziumVsPublisher: the same outbox rows relayed to Kafka by
// Debezium 3.6.1.Final (embedded engine, pgoutput, outbox EventRouter,
// acks=all; run by debezium.sh) and by outboxrelay's cmd/publisher, each
// as its own process on a fresh database of one PostgreSQL server with
// wal_level=logical and a fresh 6-partition topic of the shared broker.
//
//   - backlog: DEBEZIUM_BENCH_EVENTS (200,000) ~500-byte events on 10,000
//     keys are committed in transactions of 1,000 while the peer is down
//     (Debezium's slot exists), then the peer starts; events/s counts from
//     the first to the last arrival at a Kafka consumer, start-up apart.
//   - latency: the peer runs; a writer commits events at each of
//     DEBEZIUM_BENCH_RATES (1,000 and 10,000/s) for DEBEZIUM_BENCH_SECONDS
//     (15) after a DEBEZIUM_BENCH_WARMUP (5 s) warm-up that is not counted, rate/1,000 events per
//     transaction (one at 1,000/s), from 8 connections; latency is a
//     consumer's arrival time minus the writer's commit time.
//
// Debezium runs twice: with its defaults, and with poll.interval.ms=10
// (its default 500 ms is how long the engine waits to fill a batch of
// 2,048, which is most of its latency at a steady rate). Rounds
// (BENCH_REPEATS, default 3) run the peers in rotating order; medians are
// reported. The table goes to the log and the JSON to DEBEZIUM_BENCH_OUT
// (bench/results/debezium.json).
func BenchmarkDebeziumVsPublisher(b *testing.B) {
	s := readSettings(b)
	brokers := stack.KafkaBrokers(b)
	buildDebezium(b)
	publisher := testproc.Build(b, "publisher")
	srv := newServer(b)
	all := map[string]peer{
		"debezium":           debeziumPeer("debezium", brokers),
		"debezium-poll-10ms": debeziumPeer("debezium-poll-10ms", brokers, "poll.interval.ms=10"),
		"publisher":          publisherPeer(publisher, brokers),
	}
	var peers []peer
	for _, name := range s.peers {
		p, ok := all[name]
		if !ok {
			b.Fatalf("DEBEZIUM_BENCH_PEERS: %q is none of debezium, debezium-poll-10ms, publisher", name)
		}
		peers = append(peers, p)
	}
	rounds := benchround.Repeats(b)
	type run struct {
		scenario string
		rate     int
	}
	var runs []run
	for _, sc := range s.scenarios {
		if sc == "backlog" {
			runs = append(runs, run{scenario: sc})
			continue
		}
		for _, r := range s.rates {
			runs = append(runs, run{scenario: sc, rate: r})
		}
	}
	var results []Result
	versions := map[string]string{"debezium": debeziumVersion, "postgres": serverVersion(b, srv.url), "java": javaVersion()}
	// The file is written after every run, so a run cut short (a timeout,
	// a failure) still leaves what it measured.
	write := func() []Result {
		summary := medians(results)
		rep := Report{
			Benchmark: "debezium-vs-publisher",
			Date:      time.Now().UTC().Format(time.RFC3339),
			Machine:   machine(),
			Versions:  versions,
			Settings: map[string]any{"backlog_events": s.backlog, "keys": keys, "payload_bytes": payloadPad + 70, "partitions": partitions,
				"rates": s.rates, "seconds": s.seconds.Seconds(), "warmup_s": s.warmup.Seconds(), "rounds": rounds,
				"backlog_tx_events": backlogTx, "writers": writers},
			Runs:    results,
			Summary: summary,
		}
		if err := os.MkdirAll(filepath.Dir(s.out), 0o755); err != nil {
			b.Fatal(err)
		}
		data, err := json.MarshalIndent(rep, "", "  ")
		if err != nil {
			b.Fatal(err)
		}
		if err := os.WriteFile(s.out, append(data, '\n'), 0o644); err != nil {
			b.Fatalf("write results: %v", err)
		}
		return summary
	}
	for round := 1; round <= rounds; round++ {
		for _, r := range runs {
			for i := range peers {
				p := peers[(i+round-1)%len(peers)]
				if r.scenario == "backlog" && p.name == "debezium-poll-10ms" {
					continue // a backlog fills every batch before the poll interval matters
				}
				var res Result
				if r.scenario == "backlog" {
					res = backlog(b, srv, brokers, p, s.backlog)
				} else {
					res = latency(b, srv, brokers, p, r.rate, s.warmup, s.seconds)
				}
				res.Round = round
				results = append(results, res)
				b.Logf("round %d: %s", round, res.line())
				write()
			}
		}
	}
	summary := write()
	b.Log("\n" + table(summary, rounds))
	b.Logf("results written to %s", s.out)
	for _, r := range summary {
		unit := r.Peer + "-" + r.Scenario
		if r.Scenario == "backlog" {
			b.ReportMetric(r.EventsPerSec, "events/s-"+unit)
		} else {
			b.ReportMetric(r.P99Ms, fmt.Sprintf("p99-ms-%s-%d", unit, r.OfferedPerSec))
		}
	}
}

const (
	backlogTx = 1000 // events per transaction of the backlog
	writers   = 8    // writer connections of the latency runs
)

// backlog times one peer draining events that were committed before it
// started.
func backlog(b *testing.B, srv *server, brokers []string, p peer, n int) Result {
	dbURL, dropDB := srv.database(b)
	defer dropDB()
	topic, dropTopic := createTopic(b, brokers)
	defer dropTopic()
	pool, err := pgxpool.New(context.Background(), dbURL)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	p.prepare(b, dbURL)
	for g := 0; g < n; g += backlogTx {
		batch := make([]string, 0, backlogTx)
		for i := g; i < min(g+backlogTx, n); i++ {
			batch = append(batch, strconv.Itoa(i%keys))
		}
		insertEvents(b, pool, topic, batch, int64(g/keys+1))
	}
	// As a backlog that waited a while: hint bits set, statistics known.
	if _, err := pool.Exec(context.Background(), `VACUUM ANALYZE outbox_events`); err != nil {
		b.Fatal(err)
	}
	c := newConsumer(b, brokers, topic, false)
	defer c.close()
	start := time.Now()
	proc := p.start(b, dbURL)
	all := c.waitDistinct(n, 10*time.Minute)
	cpu := stop(b, p.name, proc)
	got := c.counts()
	if !all {
		b.Errorf("%s backlog: %d of %d events arrived in 10 minutes\nstderr:\n%s", p.name, got.distinct, n, tail(proc.Stderr(), 30))
	}
	r := Result{Peer: p.name, Scenario: "backlog", Events: got.distinct, Missing: n - got.distinct, Duplicates: got.dupes,
		PeerCPUSec: cpu.Seconds()}
	if got.distinct > 0 {
		r.EventsPerSec = float64(got.distinct) / got.last.Sub(got.first).Seconds()
		r.SteadyPerSec = float64(got.distinct*8/10) / got.p90.Sub(got.p10).Seconds()
		r.StartupSec = got.first.Sub(start).Seconds()
		r.TotalSec = got.last.Sub(start).Seconds()
	}
	return r
}

// latency offers events at a steady rate to a running peer and measures
// commit → arrival.
func latency(b *testing.B, srv *server, brokers []string, p peer, rate int, warmup, measure time.Duration) Result {
	dbURL, dropDB := srv.database(b)
	defer dropDB()
	topic, dropTopic := createTopic(b, brokers)
	defer dropTopic()
	pool, err := pgxpool.New(context.Background(), withParam(dbURL, "pool_max_conns", strconv.Itoa(writers+1)))
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	p.prepare(b, dbURL)
	c := newConsumer(b, brokers, topic, false)
	defer c.close()
	proc := p.start(b, dbURL)
	probes := waitReady(b, pool, c, topic, proc, p.name)
	cpu0 := processCPU(proc.Cmd.Process.Pid)

	// Each transaction carries perTx events; transaction j of the run is
	// due at start + j·perTx/rate, and a writer that falls behind sends the
	// next one at once, so a slow commit does not lower the offered rate.
	perTx := max(1, rate/1000)
	total := int((warmup + measure).Seconds() * float64(rate))
	txs := (total + perTx - 1) / perTx
	commits := make([]time.Time, txs)
	var wg sync.WaitGroup
	start := time.Now().Add(50 * time.Millisecond)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			keys := make([]string, perTx)
			for j := w; j < txs; j += writers {
				due := start.Add(time.Duration(float64(j*perTx) / float64(rate) * float64(time.Second)))
				if d := time.Until(due); d > 0 {
					time.Sleep(d) // pacing the offered load, not waiting for a result
				}
				for k := range keys {
					keys[k] = "e-" + strconv.Itoa(j*perTx+k)
				}
				if _, err := pool.Exec(context.Background(), insertSQL, topic, 1, payloadPad, keys); err != nil {
					b.Errorf("%s latency writer: %v", p.name, err)
					return
				}
				commits[j] = time.Now()
			}
		}()
	}
	wg.Wait()
	wrote := time.Since(start)
	// A peer slower than the offered rate drains its lag after the writer
	// ends: two minutes, plus a second for every 2,000 events.
	wait := 2*time.Minute + time.Duration(txs*perTx/2000)*time.Second
	all := c.waitDistinct(probes+txs*perTx, wait)
	cpu := processCPU(proc.Cmd.Process.Pid) - cpu0
	stop(b, p.name, proc)
	got := c.counts()
	if !all {
		b.Errorf("%s at %d/s: only %d of %d events (probes included) arrived within %s after the writer ended",
			p.name, rate, got.distinct, probes+txs*perTx, wait)
	}
	var lat []time.Duration
	missing := 0
	warm := start.Add(warmup)
	for j, commit := range commits {
		if commit.Before(warm) {
			continue
		}
		for k := range perTx {
			at, ok := c.arrived("e-" + strconv.Itoa(j*perTx+k))
			if !ok {
				missing++
				continue
			}
			lat = append(lat, at.Sub(commit))
		}
	}
	r := Result{Peer: p.name, Scenario: "latency", Events: len(lat), OfferedPerSec: rate,
		AchievedPerSec: float64(txs*perTx) / wrote.Seconds(), Missing: missing, Duplicates: got.dupes, PeerCPUSec: cpu.Seconds()}
	if len(lat) > 0 {
		slices.Sort(lat)
		ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
		r.P50Ms, r.P99Ms, r.MaxMs = ms(lat[len(lat)/2]), ms(lat[len(lat)*99/100]), ms(lat[len(lat)-1])
	}
	return r
}

func (r Result) line() string {
	if r.Scenario == "backlog" {
		return fmt.Sprintf("%s backlog: %d events at %.0f events/s, middle 80%% at %.0f events/s (start-up %.1f s, total %.1f s; missing %d, duplicates %d; peer CPU %.1f s)",
			r.Peer, r.Events, r.EventsPerSec, r.SteadyPerSec, r.StartupSec, r.TotalSec, r.Missing, r.Duplicates, r.PeerCPUSec)
	}
	return fmt.Sprintf("%s at %d/s offered (%.0f/s committed): %d samples, p50 %.1f ms, p99 %.1f ms, max %.1f ms (missing %d, duplicates %d; peer CPU %.1f s)",
		r.Peer, r.OfferedPerSec, r.AchievedPerSec, r.Events, r.P50Ms, r.P99Ms, r.MaxMs, r.Missing, r.Duplicates, r.PeerCPUSec)
}

// medians folds the rounds into one Result per peer, scenario and rate:
// each figure is its own median over the rounds.
func medians(runs []Result) []Result {
	type key struct {
		peer, scenario string
		rate           int
	}
	var order []key
	groups := map[key][]Result{}
	for _, r := range runs {
		k := key{r.Peer, r.Scenario, r.OfferedPerSec}
		if _, ok := groups[k]; !ok {
			order = append(order, k)
		}
		groups[k] = append(groups[k], r)
	}
	slices.SortStableFunc(order, func(a, b key) int {
		return cmp.Or(cmp.Compare(a.scenario, b.scenario), cmp.Compare(a.rate, b.rate), cmp.Compare(a.peer, b.peer))
	})
	med := func(rs []Result, f func(Result) float64) float64 {
		var s benchround.Series
		for _, r := range rs {
			s = append(s, f(r))
		}
		return s.Median()
	}
	var out []Result
	for _, k := range order {
		rs := groups[k]
		out = append(out, Result{Peer: k.peer, Scenario: k.scenario, OfferedPerSec: k.rate,
			Events:         int(med(rs, func(r Result) float64 { return float64(r.Events) })),
			EventsPerSec:   med(rs, func(r Result) float64 { return r.EventsPerSec }),
			SteadyPerSec:   med(rs, func(r Result) float64 { return r.SteadyPerSec }),
			StartupSec:     med(rs, func(r Result) float64 { return r.StartupSec }),
			TotalSec:       med(rs, func(r Result) float64 { return r.TotalSec }),
			AchievedPerSec: med(rs, func(r Result) float64 { return r.AchievedPerSec }),
			P50Ms:          med(rs, func(r Result) float64 { return r.P50Ms }),
			P99Ms:          med(rs, func(r Result) float64 { return r.P99Ms }),
			MaxMs:          med(rs, func(r Result) float64 { return r.MaxMs }),
			Missing:        int(med(rs, func(r Result) float64 { return float64(r.Missing) })),
			Duplicates:     int(med(rs, func(r Result) float64 { return float64(r.Duplicates) })),
			PeerCPUSec:     med(rs, func(r Result) float64 { return r.PeerCPUSec }),
		})
	}
	return out
}

// table prints the medians as Markdown.
func table(summary []Result, rounds int) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "Debezium %s vs outboxrelay publisher, medians of %d round(s), %s\n\n", debeziumVersion, rounds, time.Now().UTC().Format("2006-01-02"))
	sb.WriteString("| peer | scenario | events/s | middle 80% events/s | start-up s | p50 ms | p99 ms | max ms | peer CPU s | missing | dupes |\n")
	sb.WriteString("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range summary {
		if r.Scenario == "backlog" {
			fmt.Fprintf(&sb, "| %s | backlog %d | %.0f | %.0f | %.1f | | | | %.1f | %d | %d |\n",
				r.Peer, r.Events, r.EventsPerSec, r.SteadyPerSec, r.StartupSec, r.PeerCPUSec, r.Missing, r.Duplicates)
		} else {
			fmt.Fprintf(&sb, "| %s | %d/s offered | %.0f committed | | | %.1f | %.1f | %.1f | %.1f | %d | %d |\n",
				r.Peer, r.OfferedPerSec, r.AchievedPerSec, r.P50Ms, r.P99Ms, r.MaxMs, r.PeerCPUSec, r.Missing, r.Duplicates)
		}
	}
	return sb.String()
}

func machine() map[string]string {
	m := map[string]string{"cpus": strconv.Itoa(runtime.NumCPU()), "goos": runtime.GOOS, "goarch": runtime.GOARCH}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if name, ok := strings.CutPrefix(l, "model name"); ok {
				m["cpu"] = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(name), ":"))
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		if l, _, ok := strings.Cut(string(b), "\n"); ok {
			m["memory"] = strings.Join(strings.Fields(strings.TrimPrefix(l, "MemTotal:")), " ")
		}
	}
	return m
}

func serverVersion(b *testing.B, url string) string {
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	var v string
	if err := pool.QueryRow(context.Background(), `SHOW server_version`).Scan(&v); err != nil {
		b.Fatal(err)
	}
	return v
}

func javaVersion() string {
	out, err := exec.Command(cmp.Or(os.Getenv("JAVA"), "java"), "-version").CombinedOutput()
	if err != nil {
		return "unknown"
	}
	first, _, _ := strings.Cut(string(out), "\n")
	return strings.TrimSpace(first)
}

// withParam adds a query parameter to a connection URL.
func withParam(url, key, value string) string {
	if strings.Contains(url, "?") {
		return url + "&" + key + "=" + value
	}
	return url + "?" + key + "=" + value
}
