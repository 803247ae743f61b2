package stack

import "testing"

// Engine is a search engine the engine-facing tests run against.
type Engine struct {
	Name string
	URL  func(testing.TB) string
}

// Engines are OpenSearch 2.19 (ELASTICSEARCH_URL) and Elasticsearch 7.17
// (ELASTICSEARCH7_URL).
var Engines = []Engine{
	{Name: "opensearch", URL: ElasticsearchURL},
	{Name: "elasticsearch-7.17", URL: Elasticsearch7URL},
}

// EachEngine runs fn as a subtest per engine with that engine's URL; fn
// may call t.Parallel.
func EachEngine(t *testing.T, fn func(t *testing.T, url string)) {
	t.Helper()
	for _, e := range Engines {
		t.Run(e.Name, func(t *testing.T) { fn(t, e.URL(t)) })
	}
}
