package batch_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// A changed document section under the same processor version, run once
// with --resume, is declared compatible: the run goes ahead, documents
// already built stay as they are, and checkpoint_audit records who declared
// what. From then on the new section is the one that version ran with:
// later runs need no --resume, rows that change get the new document, and
// the old section is the one refused.
func TestDocumentChangeDeclaredCompatibleWithResume(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	bin := testproc.Build(t, "batcher")
	url, pool := newDB(t)
	seed(t, pool, 0, 400, 3, 1)
	cmd := func(args ...string) *testproc.Proc {
		t.Helper()
		return testproc.Run(t, time.Minute, bin, env(url), args...)
	}
	titles := func(tr ...string) string {
		return writeSpec(t, spec(func(s *batch.Spec) {
			for i := range s.Document.Fields {
				if s.Document.Fields[i].Name == "title" {
					s.Document.Fields[i].Transforms = tr
				}
			}
		}))
	}
	upperTitles := func() (n int) {
		t.Helper()
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM normalized_records WHERE document->>'title' = upper(document->>'title')`).Scan(&n))
		return n
	}
	p := cmd("run", "--spec", titles("trim"))
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	upper := titles("trim", "upper")
	p = cmd("run", "--spec", upper)
	require.Equal(t, 3, p.ExitCode(), "refused without --resume: %s", p.Stderr())
	require.Contains(t, p.Stderr(), "--resume")

	p = cmd("run", "--spec", upper, "--resume")
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	type audit struct {
		Job, Run, Actor, Reason, Action string
	}
	var a []audit
	rows, err := pool.Query(ctx, `SELECT job, logical_run_id, actor, reason, action FROM checkpoint_audit ORDER BY id`)
	require.NoError(t, err)
	for rows.Next() {
		var r audit
		require.NoError(t, rows.Scan(&r.Job, &r.Run, &r.Actor, &r.Reason, &r.Action))
		a = append(a, r)
	}
	require.NoError(t, rows.Err())
	require.Len(t, a, 1, "%+v", a)
	require.Equal(t, "records", a[0].Job)
	require.Equal(t, "document-compatible", a[0].Action)
	require.NotEmpty(t, a[0].Actor)
	require.Equal(t, "document changed under processor version v1, declared compatible: document.fields[title].transforms [trim] -> [trim upper]", a[0].Reason)
	require.Zero(t, upperTitles(), "documents already built stay as they are")

	// The new section is now v1's: no --resume, no new audit, and a row
	// that changes is built by it.
	_, err = pool.Exec(ctx, `UPDATE source_records SET payload = payload || '{"title": " changed "}' WHERE id = (SELECT min(id) FROM source_records)`)
	require.NoError(t, err)
	p = cmd("run", "--spec", upper)
	require.Equal(t, 0, p.ExitCode(), p.Stderr())
	require.Equal(t, 1, upperTitles(), "the changed row has the new document")
	var title string
	require.NoError(t, pool.QueryRow(ctx, `SELECT document->>'title' FROM normalized_records WHERE source_id = (SELECT min(id)::text FROM source_records)`).Scan(&title))
	require.Equal(t, "CHANGED", title)
	var audits int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM checkpoint_audit`).Scan(&audits))
	require.Equal(t, 1, audits)
	p = cmd("run", "--spec", titles("trim"))
	require.Equal(t, 3, p.ExitCode(), "v1 ran with [trim upper] since: %s", p.Stderr())
	require.Contains(t, p.Stderr(), "document.fields[title].transforms [trim upper] -> [trim]")
}
