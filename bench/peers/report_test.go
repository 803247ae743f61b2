package bench_peers

import (
	"encoding/json"
	"fmt"
	"image/color"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

const (
	kindInitial = "initial sync"
	kindChanges = "table changes"
	kindEvents  = "application events"
	kindDeletes = "table deletes"
)

// leg is one measurement of one tool.
type leg struct {
	Tool       string  `json:"tool"`
	Kind       string  `json:"kind"`
	Round      int     `json:"round"`
	Docs       int64   `json:"docs,omitempty"`        // initial sync: documents searchable at the end
	Seconds    float64 `json:"seconds,omitempty"`     // initial sync: start → all searchable; rename: commit → all searchable
	ProcessCPU float64 `json:"process_cpu,omitempty"` // initial sync: CPU-s of the tool's own processes
	// SearchCPU, PostgresCPU: initial sync, CPU-s of the shared search
	// engine (0: not measured, the engine is not this checkout's stack)
	// and of the private PostgreSQL cluster.
	SearchCPU   float64 `json:"search_cpu,omitempty"`
	PostgresCPU float64 `json:"postgres_cpu,omitempty"`
	Rate        int     `json:"rate,omitempty"`     // changes or events per second asked for
	Achieved    float64 `json:"achieved,omitempty"` // and committed
	Events      int     `json:"events,omitempty"`
	Lost        int     `json:"not_searchable,omitempty"` // not searchable (table deletes: still searchable) a minute after the last commit
	P50ms       float64 `json:"p50_ms,omitempty"`
	P99ms       float64 `json:"p99_ms,omitempty"`
	MaxMs       float64 `json:"max_ms,omitempty"`
	latencies   []float64

	// TopicP50ms, TopicP99ms: relation changes, commit → the rebuilt
	// document's event on the topic (outboxrelay's batcher and publisher).
	TopicP50ms float64 `json:"topic_p50_ms,omitempty"`
	TopicP99ms float64 `json:"topic_p99_ms,omitempty"`

	// FirstSeconds: rename, commit → the first document searchable with the new name.
	FirstSeconds float64 `json:"first_seconds,omitempty"`
}

type results struct {
	Date     time.Time       `json:"date"`
	Machine  string          `json:"machine"`
	Rows     int             `json:"rows"`
	Rounds   int             `json:"rounds"`
	Settings settings        `json:"settings"`
	Legs     []leg           `json:"legs"`
	Debezium *debeziumReport `json:"debezium,omitempty"`
}

func (r *results) add(l []leg) { r.Legs = append(r.Legs, l...) }

// debeziumResult is one summary row of bench/peers/debezium's results
// (its Result type; the fields this table shows).
type debeziumResult struct {
	Peer           string  `json:"peer"`
	Scenario       string  `json:"scenario"`
	Round          int     `json:"round"`
	Events         int     `json:"events"`
	EventsPerSec   float64 `json:"events_per_s"`
	SteadyPerSec   float64 `json:"steady_events_per_s"`
	OfferedPerSec  int     `json:"offered_per_s"`
	AchievedPerSec float64 `json:"achieved_per_s"`
	P50Ms          float64 `json:"p50_ms"`
	P99Ms          float64 `json:"p99_ms"`
	Missing        int     `json:"missing"`
	PeerCPUSec     float64 `json:"peer_cpu_s"`
}

type debeziumReport struct {
	Date    string           `json:"date"`
	Summary []debeziumResult `json:"summary"`
}

// loadDebezium reads the Debezium benchmark's results when
// BENCH_PEERS_DEBEZIUM_JSON names them (make bench-peers runs it first, in
// the same run); nil otherwise.
func loadDebezium() (*debeziumReport, error) {
	path := os.Getenv("BENCH_PEERS_DEBEZIUM_JSON")
	if path == "" {
		return nil, nil
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("BENCH_PEERS_DEBEZIUM_JSON=%s: %w", path, err)
	}
	var r debeziumReport
	if err := json.Unmarshal(raw, &r); err != nil {
		return nil, fmt.Errorf("BENCH_PEERS_DEBEZIUM_JSON=%s: %w", path, err)
	}
	return &r, nil
}

// debeziumRows are the table rows of the Debezium comparison: the same
// outbox rows relayed to Kafka by Debezium and by the publisher.
func (r *results) debeziumRows(b *strings.Builder) {
	if r.Debezium == nil {
		b.WriteString("| Debezium 3.6.1 outbox → Kafka vs the publisher | not measured in this run (`make bench-peers` runs bench/peers/debezium first and passes its results in BENCH_PEERS_DEBEZIUM_JSON) | | |\n")
		return
	}
	find := func(peer, scenario string, rate int) (debeziumResult, bool) {
		for _, x := range r.Debezium.Summary {
			if x.Peer == peer && x.Scenario == scenario && x.OfferedPerSec == rate {
				return x, true
			}
		}
		return debeziumResult{}, false
	}
	d, okD := find("debezium", "backlog", 0)
	p, okP := find("publisher", "backlog", 0)
	if okD && okP {
		fmt.Fprintf(b, "| outbox → Kafka, a backlog of %d events: events/s (Debezium 3.6.1 embedded vs publisher; %s) | Debezium %.0f/s (CPU %.1f s) | publisher %.0f/s (CPU %.1f s) | **%.2f×** events/s |\n",
			p.Events, r.Debezium.Date, d.EventsPerSec, d.PeerCPUSec, p.EventsPerSec, p.PeerCPUSec, p.EventsPerSec/d.EventsPerSec)
	}
	for _, x := range r.Debezium.Summary {
		if x.Peer != "publisher" || x.Scenario != "latency" {
			continue
		}
		cellFor := func(y debeziumResult) string {
			return fmt.Sprintf("p50 %s / p99 %s (%.0f/s committed, %d missing)", ms(y.P50Ms), ms(y.P99Ms), y.AchievedPerSec, y.Missing)
		}
		dz, ok := find("debezium", "latency", x.OfferedPerSec)
		dcell, ratio := "—", "—"
		if ok {
			dcell, ratio = "Debezium "+cellFor(dz), fmt.Sprintf("**%.2f×** p99", x.P99Ms/dz.P99Ms)
		}
		fmt.Fprintf(b, "| outbox → Kafka at %d events/s, commit → on Kafka | %s | publisher %s | %s |\n", x.OfferedPerSec, dcell, cellFor(x), ratio)
	}
}

// median of f over the legs of tool and kind (and rate, for latency legs).
func (r *results) median(tool, kind string, rate int, f func(leg) float64) (float64, bool) {
	var v []float64
	for _, l := range r.Legs {
		if l.Tool == tool && l.Kind == kind && l.Rate == rate {
			v = append(v, f(l))
		}
	}
	if len(v) == 0 {
		return 0, false
	}
	slices.Sort(v)
	return v[len(v)/2], true
}

func (r *results) write(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("results directory %s: %w", dir, err)
	}
	raw, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "peers.json"), raw, 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "peers.md"), []byte(r.markdown()), 0o644); err != nil {
		return err
	}
	if err := r.throughputPlot(filepath.Join(dir, "peers-throughput.png")); err != nil {
		return fmt.Errorf("throughput plot: %w", err)
	}
	if err := r.latencyPlot(filepath.Join(dir, "peers-latency.png")); err != nil {
		return fmt.Errorf("latency plot: %w", err)
	}
	return nil
}

const pgsyncName, ourName = "PGSync 7.3.0", "outboxrelay"

func (r *results) markdown() string {
	var b strings.Builder
	var data []string
	if r.Settings.RunsRecords() {
		data = append(data, fmt.Sprintf("%d rows (bench-e2e seed)", r.Rows))
	}
	if r.Settings.Runs(legRelations) {
		data = append(data, fmt.Sprintf("relations: a catalog of %d products, %d variants, brand 1 shared by %d products",
			r.Settings.RelProducts, r.Settings.RelProducts*relVariants, r.Settings.relShared()))
	}
	fmt.Fprintf(&b, "`make bench-peers` — %s, %s; %s, %d round(s), OpenSearch %s; medians over rounds\n\n",
		r.Date.Format("2006-01-02 15:04 UTC"), r.Machine, strings.Join(data, "; "), r.Rounds, searchVersion())
	if r.Settings.Partial() {
		beside := ", beside the initial syncs every run needs"
		if !r.Settings.RunsRecords() {
			beside = ""
		}
		fmt.Fprintf(&b, "**Partial run: only the latency legs %s (BENCH_PEERS_LEGS)%s; not the table of docs/benchmarks.md.**\n\n",
			strings.Join(r.Settings.Legs, ", "), beside)
	}
	b.WriteString("| measurement | peer (PGSync 7.3.0; Debezium 3.6.1.Final) | outboxrelay | outboxrelay / peer |\n|---|---|---|---|\n")
	sec := func(l leg) float64 { return l.Seconds }
	ps, okP := r.median(pgsyncName, kindInitial, 0, sec)
	os_, okO := r.median(ourName, kindInitial, 0, sec)
	pcpu, _ := r.median(pgsyncName, kindInitial, 0, func(l leg) float64 { return l.ProcessCPU })
	ocpu, _ := r.median(ourName, kindInitial, 0, func(l leg) float64 { return l.ProcessCPU })
	cell := func(ok bool, s string) string {
		if !ok {
			return "—"
		}
		return s
	}
	ratio := "—"
	if okP && okO {
		ratio = fmt.Sprintf("**%.2f×** time", os_/ps)
	}
	if r.Settings.RunsRecords() || okP || okO {
		fmt.Fprintf(&b, "| initial sync, source → all searchable | %s | %s | %s |\n",
			cell(okP, fmt.Sprintf("%.1f s (%.0f docs/s)", ps, float64(r.Rows)/ps)),
			cell(okO, fmt.Sprintf("%.1f s (%.0f docs/s)", os_, float64(r.Rows-r.Rows/10_000)/os_)), ratio)
		fmt.Fprintf(&b, "| initial sync, CPU-s of the tool's processes | %s | %s (batcher+publisher+indexer) | |\n",
			cell(okP, fmt.Sprintf("%.1f", pcpu)), cell(okO, fmt.Sprintf("%.1f", ocpu)))
	}
	lat := func(tool, kind string, rate int) (string, float64, bool) {
		p50, ok := r.median(tool, kind, rate, func(l leg) float64 { return l.P50ms })
		if !ok {
			return "", 0, false
		}
		p99, _ := r.median(tool, kind, rate, func(l leg) float64 { return l.P99ms })
		lost, _ := r.median(tool, kind, rate, func(l leg) float64 { return float64(l.Lost) })
		ach, _ := r.median(tool, kind, rate, func(l leg) float64 { return l.Achieved })
		if none, _ := r.median(tool, kind, rate, func(l leg) float64 { return b2f(l.Lost == l.Events) }); none == 1 {
			if kind == kindDeletes {
				return fmt.Sprintf("none gone from searches within 60 s (%.0f/s committed)", ach), 0, false
			}
			return fmt.Sprintf("none searchable within 60 s (%.0f/s committed)", ach), 0, false
		}
		s := fmt.Sprintf("p50 %s / p99 %s (%.0f/s committed)", ms(p50), ms(p99), ach)
		if lost > 0 && kind == kindDeletes {
			s += fmt.Sprintf(", %.0f still searchable after 60 s", lost)
		} else if lost > 0 {
			s += fmt.Sprintf(", %.0f not searchable after 60 s", lost)
		}
		return s, p99, true
	}
	for _, rate := range r.Settings.ChangeRates {
		p, p99p, okP := lat(pgsyncName, kindChanges, rate)
		o, p99o, okO := lat(ourName, kindChanges, rate)
		if !okP && !okO && !r.Settings.Runs(legChanges) {
			continue
		}
		ratio := "—"
		if okP && okO {
			ratio = fmt.Sprintf("**%.2f×** p99", p99o/p99p)
		}
		fmt.Fprintf(&b, "| single-row UPDATEs at %d/s, commit → searchable (PGSync `--daemon`; outboxrelay `batcher run --follow`, `vanished: delete`) | %s | %s | %s |\n",
			rate, cell(p != "", p), cell(o != "", o), ratio)
	}
	for _, rate := range r.Settings.DeleteRates {
		p, p99p, okP := lat(pgsyncName, kindDeletes, rate)
		o, p99o, okO := lat(ourName, kindDeletes, rate)
		if !okP && !okO && !r.Settings.Runs(legDeletes) {
			continue
		}
		ratio := "—"
		if okP && okO {
			ratio = fmt.Sprintf("**%.2f×** p99", p99o/p99p)
		}
		fmt.Fprintf(&b, "| single-row hard DELETEs at %d/s, commit → gone from searches (PGSync `--daemon`; outboxrelay `batcher run --follow`, `vanished: delete`) | %s | %s | %s |\n",
			rate, cell(p != "", p), cell(o != "", o), ratio)
	}
	for _, rate := range r.Settings.EventRates {
		o, _, _ := lat(ourName, kindEvents, rate)
		if o == "" && !r.Settings.Runs(legEvents) {
			continue
		}
		fmt.Fprintf(&b, "| outbox.Enqueue events at %d/s (UPDATE + event in one transaction), commit → searchable | no outbox (PGSync follows tables) | %s | |\n", rate, cell(o != "", o))
	}
	r.relationsRows(&b, lat)
	r.debeziumRows(&b)
	b.WriteString("| Camel OpenSearch sink connector (indexer's peer) | not measured: not attempted in this version (see bench/peers/README.md) | | |\n")

	b.WriteString("\nEvery leg:\n\n| round | tool | leg | result |\n|---|---|---|---|\n")
	for _, l := range r.Legs {
		var res string
		if l.Kind == kindInitial || l.Kind == kindRelInitial {
			res = fmt.Sprintf("%d docs in %.1f s, process CPU %.1f s", l.Docs, l.Seconds, l.ProcessCPU)
			if l.SearchCPU > 0 {
				res += fmt.Sprintf(", search engine CPU %.1f s", l.SearchCPU)
			}
			if l.PostgresCPU > 0 {
				res += fmt.Sprintf(", PostgreSQL CPU %.1f s", l.PostgresCPU)
			}
		} else if l.Kind == kindRelRename {
			res = fmt.Sprintf("%d products searchable with the new brand name %.2f s after the commit (the first after %.2f s)", l.Docs, l.Seconds, l.FirstSeconds)
		} else {
			lost := "not searchable"
			if l.Kind == kindDeletes {
				lost = "still searchable"
			}
			res = fmt.Sprintf("%d at %d/s (%.0f/s committed): p50 %s, p99 %s, max %s, %d %s", l.Events, l.Rate, l.Achieved, ms(l.P50ms), ms(l.P99ms), ms(l.MaxMs), l.Lost, lost)
			if l.Lost == l.Events {
				res = fmt.Sprintf("%d at %d/s (%.0f/s committed): all %d %s after 60 s", l.Events, l.Rate, l.Achieved, l.Lost, lost)
			}
			if l.TopicP99ms > 0 {
				res += fmt.Sprintf("; commit → on the topic p50 %s, p99 %s", ms(l.TopicP50ms), ms(l.TopicP99ms))
			}
		}
		fmt.Fprintf(&b, "| %d | %s | %s | %s |\n", l.Round, l.Tool, l.Kind, res)
	}
	b.WriteString("\n![throughput](peers-throughput.png) ![latency](peers-latency.png)\n")
	return b.String()
}

// relationsRows are the table rows of the relations leg (relations_test.go).
func (r *results) relationsRows(b *strings.Builder, lat func(tool, kind string, rate int) (string, float64, bool)) {
	if !r.Settings.Runs(legRelations) {
		return
	}
	cell := func(ok bool, s string) string {
		if !ok {
			return "—"
		}
		return s
	}
	sec := func(l leg) float64 { return l.Seconds }
	ps, okP := r.median(pgsyncName, kindRelInitial, 0, sec)
	os_, okO := r.median(ourName, kindRelInitial, 0, sec)
	pcpu, _ := r.median(pgsyncName, kindRelInitial, 0, func(l leg) float64 { return l.ProcessCPU })
	ocpu, _ := r.median(ourName, kindRelInitial, 0, func(l leg) float64 { return l.ProcessCPU })
	ratio := "—"
	if okP && okO {
		ratio = fmt.Sprintf("**%.2f×** time", os_/ps)
	}
	n := float64(r.Settings.RelProducts)
	fmt.Fprintf(b, "| relations: initial sync of %d products with brand (object), %d variants (objects), categories through a join table (scalars) → all searchable (PGSync `children`; outboxrelay `document.relations`, incremental) | %s | %s | %s |\n",
		r.Settings.RelProducts, r.Settings.RelProducts*relVariants,
		cell(okP, fmt.Sprintf("%.1f s (%.0f docs/s), CPU %.1f s", ps, n/ps, pcpu)),
		cell(okO, fmt.Sprintf("%.1f s (%.0f docs/s), CPU %.1f s", os_, n/os_, ocpu)), ratio)
	for _, rate := range r.Settings.RelRates {
		p, p99p, okP := lat(pgsyncName, kindRelChanges, rate)
		o, p99o, okO := lat(ourName, kindRelChanges, rate)
		ratio := "—"
		if okP && okO {
			ratio = fmt.Sprintf("**%.2f×** p99", p99o/p99p)
		}
		fmt.Fprintf(b, "| relations: variant UPDATEs at %d/s, commit → its product searchable with the change (PGSync `--daemon`; outboxrelay `batcher run --follow`) | %s | %s | %s |\n",
			rate, cell(p != "", p), cell(o != "", o), ratio)
	}
	rename := func(tool string) (string, float64, bool) {
		all, ok := r.median(tool, kindRelRename, 0, sec)
		if !ok {
			return "", 0, false
		}
		first, _ := r.median(tool, kindRelRename, 0, func(l leg) float64 { return l.FirstSeconds })
		return fmt.Sprintf("%.2f s (the first after %.2f s)", all, first), all, true
	}
	p, pAll, okP := rename(pgsyncName)
	o, oAll, okO := rename(ourName)
	ratio = "—"
	if okP && okO {
		ratio = fmt.Sprintf("**%.2f×** time", oAll/pAll)
	}
	fmt.Fprintf(b, "| relations: brand shared by %d products renamed, commit → all of them searchable with the new name | %s | %s | %s |\n",
		r.Settings.relShared(), cell(okP, p), cell(okO, o), ratio)
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

func ms(v float64) string {
	if math.IsNaN(v) {
		return "—"
	}
	if v >= 1000 {
		return fmt.Sprintf("%.2f s", v/1000)
	}
	return fmt.Sprintf("%.0f ms", v)
}

func searchVersion() string {
	out, err := exec.Command("bash", filepath.Join(stack.RepoRoot(), "scripts", "stack", "opensearch.sh"), "version").Output()
	if err != nil {
		return "?"
	}
	return strings.TrimSpace(string(out))
}

func (r *results) throughputPlot(file string) error {
	p := plot.New()
	p.Title.Text = "Initial sync: documents searchable per second"
	p.Y.Label.Text = "docs/s (median over rounds)"
	var names []string
	var vals plotter.Values
	for _, k := range []struct{ kind, what string }{
		{kindInitial, fmt.Sprintf("%d records", r.Rows)},
		{kindRelInitial, fmt.Sprintf("%d products (relations)", r.Settings.RelProducts)},
	} {
		for _, tool := range []string{pgsyncName, ourName} {
			if v, ok := r.median(tool, k.kind, 0, func(l leg) float64 { return float64(l.Docs) / l.Seconds }); ok {
				names, vals = append(names, tool+", "+k.what), append(vals, v)
			}
		}
	}
	if len(vals) == 0 {
		return nil
	}
	bars, err := plotter.NewBarChart(vals, vg.Points(60))
	if err != nil {
		return err
	}
	bars.Color = color.RGBA{R: 60, G: 110, B: 180, A: 255}
	p.Add(bars)
	p.NominalX(names...)
	return p.Save(max(6, 3.2*vg.Length(len(vals)))*vg.Inch, 4*vg.Inch, file) // room for each bar's label
}

func (r *results) latencyPlot(file string) error {
	p := plot.New()
	p.Title.Text = "commit → searchable; deletes: commit → gone from searches (CDF, every round)"
	p.X.Label.Text = "latency (ms, log scale)"
	p.Y.Label.Text = "fraction of changes"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Legend.Top, p.Legend.Left = true, true
	groups := map[string][]float64{}
	var keys []string
	for _, l := range r.Legs {
		if l.Kind == kindInitial || l.Kind == kindRelInitial || l.Kind == kindRelRename || len(l.latencies) == 0 {
			continue
		}
		k := fmt.Sprintf("%s %s %d/s", l.Tool, l.Kind, l.Rate)
		if _, ok := groups[k]; !ok {
			keys = append(keys, k)
		}
		groups[k] = append(groups[k], l.latencies...)
	}
	if len(keys) == 0 {
		return nil
	}
	var lines []any
	for _, k := range keys {
		v := groups[k]
		slices.Sort(v)
		step := max(1, len(v)/500)
		var xys plotter.XYs
		for i := 0; i < len(v); i += step {
			xys = append(xys, plotter.XY{X: max(1, v[i]), Y: float64(i+1) / float64(len(v))})
		}
		xys = append(xys, plotter.XY{X: max(1, v[len(v)-1]), Y: 1})
		lines = append(lines, k, xys)
	}
	if err := plotutil.AddLines(p, lines...); err != nil {
		return err
	}
	return p.Save(8*vg.Inch, 5*vg.Inch, file)
}

// updateBenchmarksPage puts the table and plots of the run between the
// bench-peers markers of docs/benchmarks.md, so it shows the latest run;
// resultsDir is the results' path relative to the page.
func updateBenchmarksPage(page, resultsDir, table string) error {
	raw, err := os.ReadFile(page)
	if err != nil {
		return err
	}
	const begin, end = "<!-- bench-peers:begin -->\n", "<!-- bench-peers:end -->"
	s := string(raw)
	i, j := strings.Index(s, begin), strings.Index(s, end)
	if i < 0 || j < i {
		return fmt.Errorf("%s: no %q … %q markers", page, strings.TrimSpace(begin), end)
	}
	table = strings.NewReplacer("](peers-", "]("+resultsDir+"/peers-").Replace(table)
	return os.WriteFile(page, []byte(s[:i+len(begin)]+table+s[j:]), 0o644)
}
