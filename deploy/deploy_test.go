package deploy_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/deploy"
	"github.com/outboxrelay/outboxrelay/internal/metrics"
	"github.com/outboxrelay/outboxrelay/outbox"
	"github.com/outboxrelay/outboxrelay/sink"
)

// recorder is a Registerer that keeps what the services register on it, so
// vectors that have no series yet (a dead-letter code never seen) still
// count as registered.
type recorder struct {
	*prometheus.Registry
	collectors []prometheus.Collector
}

func (r *recorder) Register(c prometheus.Collector) error {
	r.collectors = append(r.collectors, c)
	return r.Registry.Register(c)
}

func (r *recorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

// family is a registered metric: its variable labels, and whether it is a
// histogram (selected as _bucket, _sum, _count).
type family struct {
	labels    []string
	histogram bool
}

// noDB satisfies batch.NewMetrics' database parameter: a database with no
// runs, so batch_checkpoint_age_seconds is registered and collects nothing.
type noDB struct{}

type noRows struct{}

func (noRows) Close()                                       {}
func (noRows) Err() error                                   { return nil }
func (noRows) CommandTag() pgconn.CommandTag                { return pgconn.CommandTag{} }
func (noRows) FieldDescriptions() []pgconn.FieldDescription { return nil }
func (noRows) Next() bool                                   { return false }
func (noRows) Scan(...any) error                            { return errors.New("no rows") }
func (noRows) Values() ([]any, error)                       { return nil, errors.New("no rows") }
func (noRows) RawValues() [][]byte                          { return nil }
func (noRows) Conn() *pgx.Conn                              { return nil }
func (noRows) TypeMap() *pgtype.Map                         { return nil }

func (noDB) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	return pgconn.CommandTag{}, errors.New("no database")
}
func (noDB) Query(context.Context, string, ...any) (pgx.Rows, error) { return noRows{}, nil }
func (noDB) QueryRow(context.Context, string, ...any) pgx.Row        { return nil }
func (noDB) Begin(context.Context) (pgx.Tx, error)                   { return nil, errors.New("no database") }

var descRE = regexp.MustCompile(`fqName: "([^"]+)".*variableLabels: \{([^}]*)\}`)

// registered builds the three services' metrics the way their binaries do
// (metrics.NewRegistry plus each package's constructor) without connecting
// to anything, and returns every family by name.
func registered(t *testing.T) map[string]family {
	t.Helper()
	rec := &recorder{Registry: metrics.NewRegistry()}
	batch.NewMetrics(rec, noDB{})
	rec.MustRegister(batch.NewRunStates(noDB{}, nil)) // the publisher serves it, from the database
	_, err := outbox.NewPublisher(nil, outbox.Config{Brokers: []string{"127.0.0.1:1"}, Registerer: rec})
	require.NoError(t, err)
	_, err = sink.New(sink.Config{Brokers: []string{"127.0.0.1:1"}, URL: "http://127.0.0.1:1", Registerer: rec})
	require.NoError(t, err)

	out := map[string]family{}
	for _, c := range rec.collectors {
		ch := make(chan *prometheus.Desc, 64)
		go func() { c.Describe(ch); close(ch) }()
		for d := range ch {
			m := descRE.FindStringSubmatch(d.String())
			require.NotNil(t, m, "desc %s", d)
			f := family{}
			if m[2] != "" {
				f.labels = strings.Split(m[2], ",")
			}
			switch c.(type) {
			case prometheus.Histogram, *prometheus.HistogramVec:
				f.histogram = true
			}
			out[m[1]] = f
		}
	}
	// The Go and process collectors of metrics.NewRegistry.
	fams, err := rec.Gather()
	require.NoError(t, err)
	for _, mf := range fams {
		if _, ok := out[mf.GetName()]; !ok {
			out[mf.GetName()] = family{}
		}
	}
	require.Contains(t, out, "batch_rows_processed_total")
	require.Contains(t, out, "outbox_shards_owned")
	require.Contains(t, out, "indexer_dead_lettered_total")
	require.Contains(t, out, "process_start_time_seconds")
	return out
}

// Labels every scraped series has, and the one Prometheus adds when a
// metric has its own `job` (the batcher's): exported_job.
var targetLabels = []string{"job", "instance"}

// checkSelector says what is wrong with one selector against the registered
// families ("" = nothing).
func checkSelector(fams map[string]family, s deploy.Selector) string {
	if s.Metric == "up" { // Prometheus' own per target
		return ""
	}
	name, f, ok := s.Metric, family{}, false
	if f, ok = fams[name]; !ok {
		for _, suf := range []string{"_bucket", "_sum", "_count"} {
			if base, cut := strings.CutSuffix(name, suf); cut {
				if bf, found := fams[base]; found && bf.histogram {
					f, ok = bf, true
					if suf == "_bucket" {
						f.labels = append(slices.Clip(f.labels), "le")
					}
				}
			}
		}
	}
	if !ok {
		return fmt.Sprintf("%s: metric %s is not registered by any service", s.From, name)
	}
	for l := range s.Labels {
		allowed := slices.Contains(f.labels, l) || slices.Contains(targetLabels, l) ||
			(l == "exported_job" && slices.Contains(f.labels, "job"))
		if !allowed {
			return fmt.Sprintf("%s: %s has no label %q (labels: %v)", s.From, name, l, f.labels)
		}
	}
	return ""
}

// TestDashboardAndAlertsUseRegisteredMetrics parses every PromQL expression
// of alerts.yml and the dashboard and checks each metric and matched label
// against what the services register: renaming a metric in code fails it.
func TestDashboardAndAlertsUseRegisteredMetrics(t *testing.T) {
	fams := registered(t)
	qs, err := deploy.Queries()
	require.NoError(t, err)
	sels, err := deploy.Selectors(qs)
	require.NoError(t, err)
	require.Greater(t, len(sels), 40)
	var problems []string
	for _, s := range sels {
		if p := checkSelector(fams, s); p != "" {
			problems = append(problems, p)
		}
	}
	require.Empty(t, problems)
}

// TestCheckSelectorCatchesRenames: the check itself fails on a renamed
// metric, a renamed label and a label the metric never had.
func TestCheckSelectorCatchesRenames(t *testing.T) {
	fams := registered(t)
	for _, tc := range []struct {
		name string
		sel  deploy.Selector
		ok   bool
	}{
		{"registered", deploy.Selector{Metric: "outbox_events_published_total"}, true},
		{"renamed metric", deploy.Selector{Metric: "outbox_events_sent_total"}, false},
		{"histogram bucket", deploy.Selector{Metric: "indexer_bulk_duration_seconds_bucket", Labels: map[string]string{"le": ""}}, true},
		{"counter is no histogram", deploy.Selector{Metric: "indexer_docs_total_bucket"}, false},
		{"label", deploy.Selector{Metric: "indexer_docs_total", Labels: map[string]string{"result": ""}}, true},
		{"renamed label", deploy.Selector{Metric: "indexer_docs_total", Labels: map[string]string{"outcome": ""}}, false},
		{"batch job label as scraped", deploy.Selector{Metric: "batch_checkpoint_age_seconds", Labels: map[string]string{"exported_job": ""}}, true},
		{"exported_job without job", deploy.Selector{Metric: "outbox_backlog_events", Labels: map[string]string{"exported_job": ""}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := checkSelector(fams, tc.sel)
			require.Equal(t, tc.ok, p == "", p)
		})
	}
}

// TestAlertsHaveRunbooks: every alert has a severity, a summary and a
// runbook that names its section of docs/operating.md.
func TestAlertsHaveRunbooks(t *testing.T) {
	alerts, err := deploy.Alerts()
	require.NoError(t, err)
	require.NotEmpty(t, alerts)
	page := readFile(t, "../docs/operating.md")
	for _, a := range alerts {
		require.Contains(t, []string{"page", "warning"}, a.Labels["severity"], a.Name)
		require.NotEmpty(t, a.Annotations["summary"], a.Name)
		anchor := "docs/operating.md#" + strings.ToLower(a.Name)
		require.Equal(t, anchor, a.Annotations["runbook"], a.Name)
		// GitHub's anchor of a "### OutboxBacklogOld" heading.
		require.True(t, strings.Contains(page, "\n### "+a.Name+"\n"), "docs/operating.md has no runbook section \"### %s\"", a.Name)
	}
}

// TestShardAlertKnowsTheShardCount: the unowned-shards rule compares with
// outbox.NumShards.
func TestShardAlertKnowsTheShardCount(t *testing.T) {
	alerts, err := deploy.Alerts()
	require.NoError(t, err)
	i := slices.IndexFunc(alerts, func(a deploy.Alert) bool { return a.Name == "OutboxShardsUnowned" })
	require.GreaterOrEqual(t, i, 0)
	require.Contains(t, alerts[i].Expr, fmt.Sprintf("< %d", outbox.NumShards))
	require.Contains(t, alerts[i].Annotations["summary"], fmt.Sprintf("of %d outbox shards", outbox.NumShards))
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return string(b)
}
