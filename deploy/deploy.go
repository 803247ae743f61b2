// Package deploy holds what an operator loads next to the binaries — the
// Prometheus alert rules (prometheus/alerts.yml) and the Grafana dashboard
// (grafana/outboxrelay.json) — and reads the PromQL in them, so tests can
// check every metric and label they use against what the binaries register
// (deploy_test.go, in-process) and what a real Prometheus scrapes
// (e2e/scrape_test.go).
//
// The binaries do not import this package.
package deploy

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	"github.com/prometheus/prometheus/promql/parser"
	"gopkg.in/yaml.v3"
)

var (
	//go:embed prometheus/alerts.yml
	alertsYAML []byte
	//go:embed grafana/outboxrelay.json
	dashboardJSON []byte
)

// Query is one PromQL expression and where it comes from.
type Query struct {
	From string // "alert OutboxBacklogOld", "panel Publisher/Events/s"
	Expr string
}

// Alert is one alerting rule of alerts.yml.
type Alert struct {
	Name        string            `yaml:"alert"`
	Expr        string            `yaml:"expr"`
	For         string            `yaml:"for"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

// Alerts returns the alerting rules of alerts.yml.
func Alerts() ([]Alert, error) {
	var f struct {
		Groups []struct {
			Name  string  `yaml:"name"`
			Rules []Alert `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(alertsYAML, &f); err != nil {
		return nil, fmt.Errorf("prometheus/alerts.yml: %w", err)
	}
	var out []Alert
	for _, g := range f.Groups {
		out = append(out, g.Rules...)
	}
	return out, nil
}

// Panel is one panel of the dashboard with its row.
type Panel struct {
	Row, Title, Description string
	Exprs                   []string
}

// Panels returns the dashboard's panels that query Prometheus.
func Panels() ([]Panel, error) {
	var d struct {
		Panels []struct {
			Type        string `json:"type"`
			Title       string `json:"title"`
			Description string `json:"description"`
			Targets     []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(dashboardJSON, &d); err != nil {
		return nil, fmt.Errorf("grafana/outboxrelay.json: %w", err)
	}
	var out []Panel
	row := ""
	for _, p := range d.Panels {
		if p.Type == "row" {
			row = p.Title
			continue
		}
		pn := Panel{Row: row, Title: p.Title, Description: p.Description}
		for _, t := range p.Targets {
			pn.Exprs = append(pn.Exprs, t.Expr)
		}
		out = append(out, pn)
	}
	return out, nil
}

// Queries returns every expression of the rules and the dashboard.
func Queries() ([]Query, error) {
	alerts, err := Alerts()
	if err != nil {
		return nil, err
	}
	panels, err := Panels()
	if err != nil {
		return nil, err
	}
	var out []Query
	for _, a := range alerts {
		out = append(out, Query{From: "alert " + a.Name, Expr: a.Expr})
	}
	for _, p := range panels {
		for _, e := range p.Exprs {
			out = append(out, Query{From: "panel " + p.Row + "/" + p.Title, Expr: e})
		}
	}
	return out, nil
}

// Grafana's range variables, replaced by a duration before parsing (and
// before sending a dashboard query to Prometheus).
var grafanaVars = strings.NewReplacer("$__rate_interval", "1m", "$__interval", "1m", "$__range", "1h")

// Runnable returns expr with Grafana's variables replaced, as Prometheus
// can run it.
func Runnable(expr string) string { return grafanaVars.Replace(expr) }

// Selector is one series selector in an expression: the metric name and the
// labels it matches on or is grouped by.
type Selector struct {
	From   string
	Metric string
	Labels map[string]string // label name → the matcher as written (status="quarantined"), or "by" for a grouping label of an enclosing aggregation
}

// Selectors parses every query with the PromQL parser and returns the
// selectors in it; a query that does not parse or selects no metric by name
// is an error.
func Selectors(qs []Query) ([]Selector, error) {
	p := parser.NewParser(parser.Options{})
	var out []Selector
	for _, q := range qs {
		expr, err := p.ParseExpr(Runnable(q.Expr))
		if err != nil {
			return nil, fmt.Errorf("%s: %q: %w", q.From, q.Expr, err)
		}
		var found []Selector
		parser.Inspect(expr, func(n parser.Node, path []parser.Node) error {
			vs, ok := n.(*parser.VectorSelector)
			if !ok {
				return nil
			}
			s := Selector{From: q.From, Metric: vs.Name, Labels: map[string]string{}}
			// `sum by (result) (x)` needs x to have result just as a
			// matcher does.
			for _, a := range path {
				if ag, ok := a.(*parser.AggregateExpr); ok && !ag.Without {
					for _, l := range ag.Grouping {
						s.Labels[l] = "by"
					}
				}
			}
			for _, m := range vs.LabelMatchers {
				if m.Name != "__name__" {
					s.Labels[m.Name] = m.String()
				}
			}
			found = append(found, s)
			return nil
		})
		if len(found) == 0 || slices.ContainsFunc(found, func(s Selector) bool { return s.Metric == "" }) {
			return nil, fmt.Errorf("%s: %q: every selector must name its metric", q.From, q.Expr)
		}
		out = append(out, found...)
	}
	return out, nil
}
