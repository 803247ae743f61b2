package sink

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
)

// NormalizedRowsByPV counts normalized_records rows per processor version
// (all sources), for the progress of building generations in status.
func NormalizedRowsByPV(ctx context.Context, db *pgxpool.Pool) (map[string]int64, error) {
	rows, err := db.Query(ctx, `SELECT coalesce(processor_version, ''), count(*) FROM normalized_records GROUP BY 1`)
	if err != nil {
		return nil, fmt.Errorf("count normalized rows per processor version: %w", err)
	}
	out := map[string]int64{}
	for rows.Next() {
		var pv string
		var n int64
		if err := rows.Scan(&pv, &n); err != nil {
			rows.Close()
			return nil, err
		}
		out[pv] = n
	}
	return out, rows.Err()
}

// scanByPVSQL sums, per processor version, the partitions of each job's
// newest run at that version that has not finished.
const scanByPVSQL = `
WITH newest AS (
  SELECT DISTINCT ON (job, processor_version) job, processor_version, logical_run_id
  FROM batch_runs WHERE state <> 'superseded'
  ORDER BY job, processor_version, created_at DESC
)
SELECT r.processor_version, CASE WHEN count(DISTINCT (r.job, r.logical_run_id)) = 1 THEN min(r.logical_run_id) ELSE '' END,
       sum(r.processed_count)::bigint, CASE WHEN count(r.estimated_total) = count(*) THEN sum(r.estimated_total)::bigint END
FROM batch_runs r JOIN newest n USING (job, processor_version, logical_run_id)
WHERE r.state <> 'superseded'
  AND EXISTS (SELECT FROM batch_runs u WHERE u.job = r.job AND u.logical_run_id = r.logical_run_id AND u.state NOT IN ('succeeded', 'superseded'))
GROUP BY r.processor_version`

// ScanByPV reads the scan progress of the runs under way per processor
// version (see [Status].ScanByPV).
func ScanByPV(ctx context.Context, db *pgxpool.Pool) (map[string]RunScan, error) {
	rows, err := db.Query(ctx, scanByPVSQL)
	if err != nil {
		return nil, fmt.Errorf("read the progress of runs per processor version: %w", err)
	}
	defer rows.Close()
	out := map[string]RunScan{}
	for rows.Next() {
		var pv string
		var sc RunScan
		if err := rows.Scan(&pv, &sc.Run, &sc.Processed, &sc.Estimated); err != nil {
			return nil, err
		}
		out[pv] = sc
	}
	return out, rows.Err()
}
