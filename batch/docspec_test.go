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
	// The expected title is computed from the source row, not from the
	// document: "  Title 7  " must be stored as "TITLE 7".
	var v2, upperTitles int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE n.processor_version = 'v2'),
		count(*) FILTER (WHERE n.document->>'title' = upper(btrim(s.payload->>'title')))
		FROM normalized_records n JOIN source_records s ON s.id::text = n.source_id`).Scan(&v2, &upperTitles))
	require.Equal(t, 1000, v2)
	require.Equal(t, 1000, upperTitles)
}

// Going back to an earlier processor version (after a rollback, say) with
// another document section is the same silent no-op: that version's index
// generation already holds every row at its source version, so the new
// documents would all be refused as duplicates. The check compares with
// the document that version last ran with, not only with the last spec.
func TestDocumentChangeUnderAnEarlierVersionIsRefused(t *testing.T) {
	t.Parallel()
	bin := testproc.Build(t, "batcher")
	url, pool := newDB(t)
	seed(t, pool, 0, 300, 3, 1)
	cmd := func(args ...string) *testproc.Proc {
		t.Helper()
		return testproc.Run(t, time.Minute, bin, env(url), args...)
	}
	transforms := func(pv string, tr ...string) string {
		return writeSpec(t, spec(func(s *batch.Spec) {
			s.ProcessorVersion = pv
			for i := range s.Document.Fields {
				if s.Document.Fields[i].Name == "title" {
					s.Document.Fields[i].Transforms = tr
				}
			}
		}))
	}
	p := cmd("run", "--spec", transforms("v1", "trim"))
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	p = cmd("run", "--spec", transforms("v2", "trim", "upper"))
	require.Equal(t, 0, p.ExitCode(), p.Stderr())

	p = cmd("run", "--spec", transforms("v1", "trim", "lower"))
	require.Equal(t, 3, p.ExitCode(), "v1 ran with [trim]: %s", p.Stderr())
	require.Contains(t, p.Stderr(), "processor_version is still v1")
	require.Contains(t, p.Stderr(), "document.fields[title].transforms [trim] -> [trim lower]")

	// v1's own document again is fine (a rollback's catch-up run).
	p = cmd("run", "--spec", transforms("v1", "trim"))
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	// And the job reruns from its stored spec.
	p = cmd("run", "--job", "records")
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	var v1 int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM normalized_records WHERE processor_version = 'v1'`).Scan(&v1))
	require.Equal(t, 300, v1)
}
