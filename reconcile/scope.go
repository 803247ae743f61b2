package reconcile

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"

	"github.com/olivere/elastic/v7"
	"github.com/outboxrelay/outboxrelay/sink"
)

// sourcesSQL lists the distinct sources of normalized_records by walking
// its primary key (source, source_id) one source at a time, instead of
// reading every row.
const sourcesSQL = `WITH RECURSIVE s AS (
  SELECT min(source) AS source FROM normalized_records
  UNION ALL
  SELECT (SELECT min(source) FROM normalized_records WHERE source > s.source) FROM s WHERE s.source IS NOT NULL
)
SELECT source FROM s WHERE source IS NOT NULL`

// resolveSource fills cfg.Source when it is empty and checks that it has
// rows: compared against a source without rows, every document of the
// index would be "extra" (and a repair would empty the index).
func resolveSource(ctx context.Context, cfg *Config) error {
	rows, err := cfg.DB.Query(ctx, sourcesSQL)
	if err != nil {
		return fmt.Errorf("list the sources of normalized_records: %w", err)
	}
	var sources []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			rows.Close()
			return err
		}
		sources = append(sources, s)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("list the sources of normalized_records: %w", err)
	}
	if cfg.Source != "" {
		if !slices.Contains(sources, cfg.Source) {
			return fmt.Errorf("%w: Source %q has no rows in normalized_records (sources there: %s); compared with it, every document would be extra",
				ErrSource, cfg.Source, quoteList(sources))
		}
	} else {
		switch len(sources) {
		case 0:
			return fmt.Errorf("%w: normalized_records is empty; nothing to compare (set Source to compare anyway)", ErrSource)
		case 1:
			cfg.Source = sources[0]
		default:
			// Several jobs share the table: the index may say whose it is.
			types, err := indexAggregateTypes(ctx, *cfg)
			if err != nil {
				return err
			}
			var both []string
			for _, s := range sources {
				if slices.Contains(types, s) {
					both = append(both, s)
				}
			}
			if len(both) != 1 {
				return fmt.Errorf("%w: normalized_records holds several sources (%s) and index %s holds aggregate types %s: set Source",
					ErrSource, quoteList(sources), cfg.Index, quoteList(types))
			}
			cfg.Source = both[0]
		}
	}
	cfg.AggregateType = cmp.Or(cfg.AggregateType, cfg.Source)
	return nil
}

func quoteList(l []string) string {
	if len(l) == 0 {
		return "none"
	}
	q := make([]string, len(l))
	for i, s := range l {
		q[i] = fmt.Sprintf("%q", s)
	}
	return strings.Join(q, ", ")
}

// indexAggregateTypes returns the aggregate types the index holds.
func indexAggregateTypes(ctx context.Context, cfg Config) ([]string, error) {
	field, err := aggregateTypeField(ctx, cfg)
	if err != nil {
		return nil, err
	}
	res, err := cfg.Search.Search(cfg.Index).Size(0).
		Aggregation("types", elastic.NewTermsAggregation().Field(field).Size(100)).Do(ctx)
	if err != nil {
		return nil, fmt.Errorf("list the aggregate types of index %s: %w", cfg.Index, err)
	}
	terms, _ := res.Aggregations.Terms("types")
	var out []string
	if terms != nil {
		for _, b := range terms.Buckets {
			if s, ok := b.Key.(string); ok {
				out = append(out, s)
			}
		}
	}
	return out, nil
}

// ownDocuments selects the documents compared with cfg.Source: those of
// cfg.AggregateType and those without an aggregate type (written before
// the indexer recorded it, or by hand; [Repair] never deletes them).
func ownDocuments(ctx context.Context, cfg Config) (elastic.Query, error) {
	field, err := aggregateTypeField(ctx, cfg)
	if err != nil {
		return nil, err
	}
	return elastic.NewBoolQuery().Should(
		elastic.NewTermQuery(field, cfg.AggregateType),
		elastic.NewBoolQuery().MustNot(elastic.NewExistsQuery(sink.FieldAggregateType)),
	).MinimumNumberShouldMatch(1), nil
}

// aggregateTypeField returns the field to match aggregate types on exactly:
// sink.FieldAggregateType when mapped as a keyword (the built-in mapping), its
// ".keyword" sub-field when dynamic mapping made it text.
func aggregateTypeField(ctx context.Context, cfg Config) (string, error) {
	kw := sink.FieldAggregateType + ".keyword"
	res, err := cfg.Search.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method:       http.MethodGet,
		Path:         "/" + url.PathEscape(cfg.Index) + "/_mapping/field/" + sink.FieldAggregateType + "," + kw,
		IgnoreErrors: []int{http.StatusNotFound},
	})
	if err != nil {
		return "", fmt.Errorf("read the mapping of %s in %s: %w", sink.FieldAggregateType, cfg.Index, err)
	}
	var body map[string]struct {
		Mappings map[string]struct {
			Mapping map[string]struct {
				Type string `json:"type"`
			} `json:"mapping"`
		} `json:"mappings"`
	}
	if res.StatusCode == http.StatusNotFound {
		return sink.FieldAggregateType, nil
	}
	if err := json.Unmarshal(res.Body, &body); err != nil {
		return "", fmt.Errorf("read the mapping of %s in %s: %w", sink.FieldAggregateType, cfg.Index, err)
	}
	sub := false
	for _, idx := range body {
		if f, ok := idx.Mappings[sink.FieldAggregateType]; ok && f.Mapping[sink.FieldAggregateType].Type == "keyword" {
			return sink.FieldAggregateType, nil
		}
		if _, ok := idx.Mappings[kw]; ok {
			sub = true
		}
	}
	if sub {
		return kw, nil
	}
	return sink.FieldAggregateType, nil
}
