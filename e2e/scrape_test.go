package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/common/model"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/deploy"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// prometheus is a private Prometheus (scripts/stack/prometheus.sh run)
// scraping this test's binaries every second, with deploy's alert rules.
type prometheus struct {
	url string
}

// startPrometheus writes the file_sd targets (job → address) and starts
// Prometheus in a temp dir; it is killed when the test ends.
func startPrometheus(t *testing.T, targets map[string]string) *prometheus {
	t.Helper()
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "targets"), 0o755))
	for job, addr := range targets {
		b, err := json.Marshal([]map[string]any{{"targets": []string{addr}}})
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, "targets", job+".json"), b, 0o644))
	}
	_, port, err := net.SplitHostPort(freeAddr(t))
	require.NoError(t, err)
	proc := testproc.Start(t, filepath.Join(stack.RepoRoot(), "scripts/stack/prometheus.sh"), []string{"PROMETHEUS_PORT=" + port}, "run", dir)
	url := "http://127.0.0.1:" + port
	deadline := time.Now().Add(2 * time.Minute)
	for {
		resp, err := http.Get(url + "/-/ready")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		select {
		case <-proc.Done():
			t.Fatalf("prometheus exited: %s", tail(proc.Stderr(), 20))
		default:
		}
		require.Truef(t, time.Now().Before(deadline), "prometheus not ready: %v\n%s", err, tail(proc.Stderr(), 20))
		pause(context.Background(), 200*time.Millisecond)
	}
	return &prometheus{url: url}
}

// get calls the HTTP API at path with params and decodes its data into out.
func (p *prometheus) get(t *testing.T, path string, params url.Values, out any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.url+path+"?"+params.Encode(), nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	var body struct {
		Status string          `json:"status"`
		Error  string          `json:"error"`
		Data   json.RawMessage `json:"data"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&body))
	require.Equal(t, "success", body.Status, "%s %v: %s", path, params, body.Error)
	require.NoError(t, json.Unmarshal(body.Data, out))
}

// query returns the instant vector of q now.
func (p *prometheus) query(t *testing.T, q string) model.Vector {
	t.Helper()
	var res struct {
		ResultType string       `json:"resultType"`
		Result     model.Vector `json:"result"`
	}
	p.get(t, "/api/v1/query", url.Values{"query": {q}}, &res)
	require.Equal(t, "vector", res.ResultType, q)
	return res.Result
}

// series returns the label sets of the series match selects over
// [start, now].
func (p *prometheus) series(t *testing.T, match string, start time.Time) []model.LabelSet {
	t.Helper()
	var res []model.LabelSet
	p.get(t, "/api/v1/series", url.Values{"match[]": {match}, "start": {unix(start)}, "end": {unix(time.Now())}}, &res)
	return res
}

func unix(t time.Time) string { return fmt.Sprintf("%.3f", float64(t.UnixMilli())/1000) }

// waitFor polls q until it returns one sample for which ok holds, and
// returns that value.
func (p *prometheus) waitFor(t *testing.T, q string, ok func(float64) bool, timeout time.Duration, procs func() string) float64 {
	t.Helper()
	deadline := time.Now().Add(timeout)
	last := "no sample"
	for {
		vec := p.query(t, q)
		if len(vec) == 1 {
			v := float64(vec[0].Value)
			if ok(v) {
				return v
			}
			last = fmt.Sprint(v)
		} else if len(vec) > 1 {
			last = vec.String()
		}
		require.Truef(t, time.Now().Before(deadline), "%s: not as expected within %s; last: %s\n%s", q, timeout, last, procs())
		pause(context.Background(), 500*time.Millisecond)
	}
}

// needsARebuild are the selectors whose series appear only while a new
// index generation is building (this test runs one processor version).
// They cannot be created at 0 in advance: their alias and index labels
// name a real generation, and a series for one that does not exist would
// claim a rebuild. sink's TestGenerationDocsFollowARebuild checks them in
// process. (The retry, lock-wait and skip series, whose label values are
// known in advance, exist at 0 from each process's start.)
var needsARebuild = []string{`indexer_generation_docs{state="building"}`}

// TestScrapedMetricsMatchTheRulesAndDashboard runs the pipeline under a
// real Prometheus and checks, through its HTTP API, that the series the
// alert rules and the dashboard select exist with the labels they use and
// move the way the rules assume: the backlog rises while no publisher can
// reach Kafka and falls to 0 after, processed rows reach the row count and
// the finished run is neither failed nor stalled,
// the shards are all owned, the lag per partition goes to 0, and the
// quarantine and dead-letter alerts fire on the scraped labels.
func TestScrapedMetricsMatchTheRulesAndDashboard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const rows, badEvery = 20_000, 1_000
	const bad = rows / badEvery
	p := newPipeline(t, pipelineOptions{TopicPartitions: 6})
	require.NoError(t, demo.Seed(ctx, p.pool, demo.SeedOptions{Rows: rows, BadEvery: badEvery}))

	addr := map[string]string{"batcher": freeAddr(t), "publisher": freeAddr(t), "indexer": freeAddr(t)}
	prom := startPrometheus(t, addr)
	start := time.Now()

	// A publisher that cannot reach Kafka holds the shards and reports the
	// backlog the batcher builds up, and publishes nothing.
	stuck := p.startPublisher("LOG_LEVEL=error", "METRICS_ADDR="+addr["publisher"], "KAFKA_BROKERS="+freeAddr(t),
		"BACKLOG_INTERVAL=250ms", "SHUTDOWN_GRACE=1s", "LEASE_TTL=2s")
	ix := p.startIndexer("LOG_LEVEL=warn", "METRICS_ADDR="+addr["indexer"])
	batcher := testproc.Start(t, p.batcherBin, p.env("METRICS_ADDR="+addr["batcher"], "METRICS_LINGER=10m", "LOG_LEVEL=warn"), "run", "--spec", p.specFile)
	var pub *testproc.Proc
	procs := func() string {
		s := "batcher:\n" + tail(batcher.Stderr(), 10) + "\nstuck publisher:\n" + tail(stuck.Stderr(), 10) + "\nindexer:\n" + tail(ix.Stderr(), 10)
		if pub != nil {
			s += "\npublisher:\n" + tail(pub.Stderr(), 10)
		}
		return s
	}

	// Processed rows reach the row count: the lingering batcher is scraped
	// after its last chunk.
	prom.waitFor(t, `sum(batch_rows_processed_total{job="batcher"})`, func(v float64) bool { return v == rows }, 5*time.Minute, procs)
	byStatus := prom.query(t, fmt.Sprintf(`sum by (exported_job, status) (batch_rows_processed_total{job="batcher",exported_job=%q})`, p.spec.Job))
	got := map[string]float64{}
	for _, s := range byStatus {
		got[string(s.Metric["status"])] = float64(s.Value)
	}
	require.Equal(t, map[string]float64{"changed": rows - bad, "unchanged": 0, "quarantined": bad}, got)
	prom.waitFor(t, fmt.Sprintf(`count(ALERTS{alertname="BatchRowsQuarantined",alertstate="firing",exported_job=%q})`, p.spec.Job),
		func(v float64) bool { return v == 1 }, time.Minute, procs)

	// The run's state, from the database through the (stuck) publisher:
	// what BatchRunFailed watches after a batcher has exited.
	prom.waitFor(t, fmt.Sprintf(`max(batch_runs{job="publisher",exported_job=%q,state="succeeded"})`, p.spec.Job), func(v float64) bool { return v == 1 }, time.Minute, procs)
	prom.waitFor(t, fmt.Sprintf(`max(batch_runs{job="publisher",exported_job=%q,state="failed"})`, p.spec.Job), func(v float64) bool { return v == 0 }, time.Minute, procs)
	// And what BatchRunStalled watches: the run ended with its batcher
	// alive, so nothing is stalled (the series is there, at 0).
	prom.waitFor(t, fmt.Sprintf(`max(batch_run_stalled_seconds{job="publisher",exported_job=%q})`, p.spec.Job), func(v float64) bool { return v == 0 }, time.Minute, procs)

	t.Logf("%s: all rows processed", time.Since(start).Round(time.Second))
	// The backlog rose, its oldest event ages, and the stuck publisher says
	// why it is not ready.
	prom.waitFor(t, `max(outbox_backlog_events{job="publisher"})`, func(v float64) bool { return v >= (rows-bad)/2 }, 2*time.Minute, procs)
	prom.waitFor(t, `max(outbox_oldest_event_age_seconds{job="publisher"})`, func(v float64) bool { return v > 0 }, time.Minute, procs)
	prom.waitFor(t, `sum(outbox_publish_errors_total{job="publisher",kind="broker"})`, func(v float64) bool { return v > 0 }, 2*time.Minute, procs)
	code, body := httpGet(t, "http://"+addr["publisher"]+"/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Contains(t, body, "kafka degraded")

	t.Logf("%s: backlog built up", time.Since(start).Round(time.Second))
	// A publisher that reaches Kafka drains it.
	require.NoError(t, stuck.Signal(syscall.SIGTERM))
	require.NoError(t, stuck.Wait(time.Minute), tail(stuck.Stderr(), 20))
	pub = p.startPublisher("LOG_LEVEL=warn", "METRICS_ADDR="+addr["publisher"], "BACKLOG_INTERVAL=250ms")
	prom.waitFor(t, `sum(outbox_events_published_total{job="publisher"})`, func(v float64) bool { return v >= rows-bad }, 3*time.Minute, procs)
	prom.waitFor(t, `max(outbox_backlog_events{job="publisher"})`, func(v float64) bool { return v == 0 }, 2*time.Minute, procs)
	prom.waitFor(t, `max(outbox_oldest_event_age_seconds{job="publisher"})`, func(v float64) bool { return v == 0 }, time.Minute, procs)
	prom.waitFor(t, `sum(outbox_shards_owned{job="publisher"})`, func(v float64) bool { return v == 64 }, time.Minute, procs)
	// It rose before: the peak the stuck publisher reported. (A range query
	// would show gaps: a scrape that times out on a loaded machine ends the
	// series until the next one.)
	peak := prom.query(t, `max(max_over_time(outbox_backlog_events{job="publisher"}[1h]))`)
	require.Len(t, peak, 1)
	require.GreaterOrEqual(t, float64(peak[0].Value), float64(rows-bad)/2)

	t.Logf("%s: backlog drained", time.Since(start).Round(time.Second))
	// One poison message: the indexer dead-letters it.
	w := &kafka.Writer{Addr: kafka.TCP(p.brokers...), Topic: p.topic, RequiredAcks: kafka.RequireAll}
	require.NoError(t, w.WriteMessages(ctx, kafka.Message{Key: []byte("poison-1"), Value: []byte(`{"title":"no version header"}`)}))
	require.NoError(t, w.Close())

	// Every document resolved, no lag left on any of the six partitions.
	prom.waitFor(t, `sum(indexer_docs_total{job="indexer",result="indexed"})`, func(v float64) bool { return v >= rows-bad }, 3*time.Minute, procs)
	prom.waitFor(t, `sum(indexer_dead_lettered_total{job="indexer",code="bad_version"})`, func(v float64) bool { return v == 1 }, 2*time.Minute, procs)
	prom.waitFor(t, `max(indexer_dead_letter_topic_messages{job="indexer",state="pending"})`, func(v float64) bool { return v == 1 }, 2*time.Minute, procs)
	prom.waitFor(t, `count(ALERTS{alertname="IndexerDeadLetters",alertstate="firing",code="bad_version"})`, func(v float64) bool { return v == 1 }, time.Minute, procs)
	prom.waitFor(t, `max(max by (partition) (indexer_consumer_lag{job="indexer"}))`, func(v float64) bool { return v == 0 }, 2*time.Minute, procs)
	require.Len(t, prom.query(t, `max by (partition) (last_over_time(indexer_consumer_lag{job="indexer"}[1m]))`), 6)
	s := p.waitSettled(ctx, 3*time.Minute, procs)
	require.EqualValues(t, rows-bad, s.Report.IndexDocs)
	require.EqualValues(t, rows-bad, s.Index.Live, "documents through the read alias equal to the source")
	// Both services can do their job now, and say so.
	for _, svc := range []string{"publisher", "indexer"} {
		code, body := httpGet(t, "http://"+addr[svc]+"/readyz")
		require.Equal(t, http.StatusOK, code, "%s /readyz: %s", svc, body)
	}

	t.Logf("%s: indexer caught up", time.Since(start).Round(time.Second))
	// Every selector of the rules and the dashboard finds series with the
	// labels it matches and groups by.
	qs, err := deploy.Queries()
	require.NoError(t, err)
	sels, err := deploy.Selectors(qs)
	require.NoError(t, err)
	seen := map[string][]model.LabelSet{}
	var missing []string
	for _, sel := range sels {
		match := selectorString(sel)
		series, ok := seen[match]
		if !ok {
			series = prom.series(t, match, start)
			seen[match] = series
		}
		if len(series) == 0 {
			if !slices.Contains(needsARebuild, match) {
				missing = append(missing, fmt.Sprintf("%s: no series for %s", sel.From, match))
			}
			continue
		}
		for l := range sel.Labels {
			if !slices.ContainsFunc(series, func(ls model.LabelSet) bool { _, ok := ls[model.LabelName(l)]; return ok }) {
				missing = append(missing, fmt.Sprintf("%s: no series of %s has label %s", sel.From, match, l))
			}
		}
	}
	require.Empty(t, missing)

	chunkP99 := prom.query(t, fmt.Sprintf(`histogram_quantile(0.99, sum by (le) (batch_chunk_duration_seconds_bucket{phase="total",exported_job=%q}))`, p.spec.Job))
	require.Len(t, chunkP99, 1)

	// The finished batcher stops lingering at a signal; its run succeeded.
	require.NoError(t, batcher.Signal(syscall.SIGTERM))
	require.NoError(t, batcher.Wait(time.Minute))
	require.Equal(t, 0, batcher.ExitCode(), tail(batcher.Stderr(), 20))
	require.Contains(t, batcher.Stdout(), "succeeded")

	up := prom.query(t, `min(avg_over_time(up[1h]))`)
	require.Len(t, up, 1)
	report(t, "%d rows: scraped backlog peaked at %.0f events and fell to 0; %d selectors of the rules and the dashboard checked (%d distinct); chunk p99 %.3fs; %.0f%% of scrapes answered in time (worst target); scraped for %s",
		rows, float64(peak[0].Value), len(sels), len(seen), float64(chunkP99[0].Value), 100*float64(up[0].Value), time.Since(start).Round(time.Second))
}

// selectorString prints a selector's matchers back as PromQL, sorted.
func selectorString(s deploy.Selector) string {
	var ms []string
	for _, m := range s.Labels {
		if m != "by" {
			ms = append(ms, m)
		}
	}
	sort.Strings(ms)
	return s.Metric + "{" + strings.Join(ms, ",") + "}"
}

func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}
