package batch_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// A changed document section with the same processor version would be a
// silent no-op (the upsert guard sees the same source and processor
// version), so the batcher refuses it and says what changed.
func TestDocumentChangeNeedsVersionBump(t *testing.T) {
	t.Parallel()
	bin := testproc.Build(t, "batcher")
	url, pool := newDB(t)
	seed(t, pool, 0, 1000, 3, 1)
	cmd := func(args ...string) *testproc.Proc {
		t.Helper()
		return testproc.Run(t, time.Minute, bin, env(url), args...)
	}
	p := cmd("run", "--spec", writeSpec(t, spec()))
	require.Equal(t, 0, p.ExitCode(), p.Stderr())

	upper := func(s *batch.Spec) {
		for i := range s.Document.Fields {
			if s.Document.Fields[i].Name == "title" {
				s.Document.Fields[i].Transforms = []string{"trim", "upper"}
			}
		}
		s.Document.Fields = append(s.Document.Fields, batch.Field{Name: "kind", From: "payload.kind"})
	}
	changed := writeSpec(t, spec(upper))
	p = cmd("run", "--spec", changed)
	require.Equal(t, 3, p.ExitCode(), "conflict: %s", p.Stderr())
	require.Contains(t, p.Stderr(), "document section of job records changed but processor_version is still v1")
	require.Contains(t, p.Stderr(), "document.fields[title].transforms")
	require.Contains(t, p.Stderr(), "document.fields[kind] added")
	require.Contains(t, p.Stderr(), "bump processor_version")
	// The stored spec is untouched by the refusal.
	p = cmd("run", "--spec", changed)
	require.Equal(t, 3, p.ExitCode(), p.Stderr())

	bumped := writeSpec(t, spec(upper, func(s *batch.Spec) { s.ProcessorVersion = "v2" }))
	p = cmd("run", "--spec", bumped)
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	var v2, upperTitles int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE processor_version = 'v2'),
		count(*) FILTER (WHERE document->>'title' = upper(document->>'title')) FROM normalized_records`).Scan(&v2, &upperTitles))
	require.Equal(t, 1000, v2)
	require.Equal(t, 1000, upperTitles)
}
