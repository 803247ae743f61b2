package batch_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
)

// Rows no outbox event can carry — an empty id (no Kafka key), a negative
// version, and on the Go path a document that is not a JSON object — are
// bad rows under the job's policy (quarantined here), not a chunk the
// outbox's constraints refuse (migration 018), which would fail the run
// and leave the job stuck on that row. Both paths; the good rows around
// them get their events.
func TestRowsNoEventCanCarryAreQuarantined(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, path := range []string{"sql", "go"} {
		t.Run(path, func(t *testing.T) {
			t.Parallel()
			_, pool := newDB(t)
			_, err := pool.Exec(ctx, `
CREATE TABLE keyed_records (id text PRIMARY KEY, version bigint NOT NULL, title text NOT NULL);
INSERT INTO keyed_records VALUES ('a', 1, 'fine'), ('', 1, 'empty id'), ('c', -3, 'negative version'), ('d', 2, 'array'), ('e', 1, 'fine')`)
			require.NoError(t, err)
			s := batch.Spec{Job: "keyed", ProcessorVersion: "v1", Topic: "keyed",
				Source:   batch.Source{Table: "keyed_records", Cursor: []string{"id"}, ID: "id", Version: "version"},
				Document: batch.Document{Fields: []batch.Field{{Name: "title"}}},
				Errors:   batch.ErrorPolicy{Policy: batch.PolicyQuarantine},
				Chunk:    batch.ChunkSettings{Size: 10, Min: 10, Max: 10}}
			cfg := batch.Config{}
			want := map[string]string{"": "invalid_id", "c": "invalid_version"}
			good := []string{"a", "d", "e"}
			if path == "go" {
				s.Document = batch.Document{}
				cfg.Processor = batch.ProcessorFunc(func(_ context.Context, rows []batch.SourceRow) ([]batch.Result, error) {
					out := make([]batch.Result, len(rows))
					for i, r := range rows {
						doc, _ := json.Marshal(map[string]string{"id": r.ID})
						if r.ID == "d" {
							doc = json.RawMessage(`[1, 2]`)
						}
						out[i] = batch.Result{Document: doc}
					}
					return out, nil
				})
				want["d"] = "invalid_document"
				good = []string{"a", "e"}
			}
			sum, err := run(t, pool, s, cfg)
			require.NoError(t, err)
			require.True(t, sum.Done)

			rows, err := pool.Query(ctx, `SELECT source_id, error_code FROM batch_quarantine WHERE job = 'keyed' AND resolved_at IS NULL`)
			require.NoError(t, err)
			got := map[string]string{}
			for rows.Next() {
				var id, code string
				require.NoError(t, rows.Scan(&id, &code))
				got[id] = code
			}
			require.NoError(t, rows.Err())
			require.Equal(t, want, got)

			var events []string
			require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(array_agg(aggregate_id ORDER BY aggregate_id), '{}') FROM outbox_event_members WHERE topic = 'keyed'`).Scan(&events))
			require.Equal(t, good, events)
		})
	}
}
