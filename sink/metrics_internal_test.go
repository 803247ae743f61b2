package sink

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// The retry and skip series exist at 0 from the start, one per reason, so
// a scrape before the first retry or skip has a line for each.
func TestRetryAndSkipSeriesStartAtZero(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	newMetrics(reg)
	mfs, err := reg.Gather()
	require.NoError(t, err)
	got := map[string]map[string]float64{}
	for _, mf := range mfs {
		name := mf.GetName()
		if name != "indexer_retries_total" && name != "indexer_skipped_total" {
			continue
		}
		got[name] = map[string]float64{}
		for _, m := range mf.GetMetric() {
			got[name][m.GetLabel()[0].GetValue()] = m.GetCounter().GetValue()
		}
	}
	require.Equal(t, map[string]map[string]float64{
		"indexer_retries_total": {"request": 0, "item_429": 0, "item_5xx": 0, "item_other": 0, "bisect": 0},
		"indexer_skipped_total": {"aggregate_type": 0, "event_type": 0, "null_value": 0, "txn_marker": 0},
	}, got)
}
