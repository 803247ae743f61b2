package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
	"github.com/outboxrelay/outboxrelay/sink"
)

// aliasJob is one of several jobs that write one alias: the demo job over
// some tenants of source_records, under its own source name and aggregate
// type.
type aliasJob struct {
	name    string
	tenants []string
	files   map[string]string // processor version -> spec file
}

// TestJobsOnOneAliasUpgradeOneAtATime: two, then three jobs (articles,
// notes, memos: a partition of source_records by tenant) write one alias.
// While a writer updates and soft-deletes rows of all of them, their runs
// carry the changes, and a prober searches the alias, articles is rebuilt
// at v2 (the title upper-cased) and cut over; then rolled back (after a run
// at v1); then notes is upgraded the same way. Every probe finds, for every
// job, at least its live rows and no more rows than it has (never a job's
// documents missing, never twice); after every step every job's live rows
// are found once, at their latest version, built by the job's live
// processor version.
func TestJobsOnOneAliasUpgradeOneAtATime(t *testing.T) {
	t.Parallel()
	t.Run("two jobs", func(t *testing.T) {
		t.Parallel()
		testJobsOnOneAlias(t, []*aliasJob{
			{name: "articles", tenants: []string{"tenant-0", "tenant-1"}},
			{name: "notes", tenants: []string{"tenant-2", "tenant-3"}},
		})
	})
	t.Run("three jobs", func(t *testing.T) {
		t.Parallel()
		testJobsOnOneAlias(t, []*aliasJob{
			{name: "articles", tenants: []string{"tenant-0", "tenant-1"}},
			{name: "notes", tenants: []string{"tenant-2"}},
			{name: "memos", tenants: []string{"tenant-3"}},
		})
	})
}

func testJobsOnOneAlias(t *testing.T, jobs []*aliasJob) {
	ctx := context.Background()
	const rows = 3000
	p := newPipeline(t, pipelineOptions{TopicPartitions: 3, Chunk: batch.ChunkSettings{Size: 500, Min: 500, Max: 500}})
	require.NoError(t, demo.Seed(ctx, p.pool, demo.SeedOptions{Rows: rows}))
	dir := t.TempDir()
	for _, j := range jobs {
		j.files = map[string]string{}
		for _, pv := range []string{"v1", "v2"} {
			s := p.spec
			s.Job, s.SourceName, s.AggregateType, s.ProcessorVersion = j.name, j.name, j.name, pv
			s.Source.Filter = []batch.Condition{{Column: "tenant_id", Op: "in", Values: j.tenants}}
			s.Document.Fields = slices.Clone(p.spec.Document.Fields)
			if pv == "v2" {
				for i, f := range s.Document.Fields {
					if f.Name == "title" {
						s.Document.Fields[i].Transforms = []string{"trim", "upper"}
					}
				}
			}
			b, err := json.Marshal(s)
			require.NoError(t, err)
			j.files[pv] = filepath.Join(dir, j.name+"-"+pv+".json")
			require.NoError(t, os.WriteFile(j.files[pv], b, 0o644))
		}
	}
	run := func(j *aliasJob, pv string, flags ...string) {
		t.Helper()
		b := testproc.Run(t, 3*time.Minute, p.batcherBin, p.env(), append([]string{"run", "--spec", j.files[pv], "--lease-ttl", "3s"}, flags...)...)
		require.Equal(t, 0, b.ExitCode(), "batcher run %s at %s:\n%s", j.name, pv, tail(b.Stderr(), 30))
	}
	// runJobs runs the jobs of live, each at its version, at once.
	runJobs := func(live map[string]string) {
		t.Helper()
		var wg sync.WaitGroup
		for _, j := range jobs {
			pv, ok := live[j.name]
			if !ok {
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				b := testproc.Run(t, 3*time.Minute, p.batcherBin, p.env(), "run", "--spec", j.files[pv], "--lease-ttl", "3s")
				if b.ExitCode() != 0 {
					t.Errorf("batcher run %s at %s:\n%s", j.name, pv, tail(b.Stderr(), 30))
				}
			}()
		}
		wg.Wait()
	}
	// A run's failure (t.Errorf, possibly on another goroutine) stops the
	// test here.
	runsOK := func() {
		t.Helper()
		require.False(t, t.Failed(), "a batcher run failed")
	}
	ix := p.startIndexer("LOG_LEVEL=warn", "FLUSH_INTERVAL=100ms")
	pub := p.startPublisher("LOG_LEVEL=warn", "POLL_INTERVAL=200ms")
	procs := func() string {
		return fmt.Sprintf("publisher:\n%s\nindexer:\n%s\n", tail(pub.Stderr(), 10), tail(ix.Stderr(), 10))
	}
	tenantOf := map[string]string{}
	for _, j := range jobs {
		for _, tn := range j.tenants {
			tenantOf[tn] = j.name
		}
	}

	// expectFound waits until the alias finds every live row once, built by
	// its job's processor version in live, from its latest version.
	expectFound := func(live map[string]string) {
		t.Helper()
		deadline := time.Now().Add(2 * time.Minute)
		for {
			last := p.checkSearch(ctx, tenantOf, live)
			if last == "" {
				return
			}
			require.Truef(t, time.Now().Before(deadline), "every job's live rows found at their live version %v: not within 2m; last: %s\n%s", live, last, procs())
			pause(ctx, 200*time.Millisecond)
		}
	}
	allV1 := map[string]string{"articles": "v1", "notes": "v1", "memos": "v1"}
	runJobs(allV1)
	runsOK()
	expectFound(allV1)
	v1, v2 := index.GenerationIndex(p.alias, "v1"), index.GenerationIndex(p.alias, "v2")

	// The prober: per job, what the alias finds against the source.
	var probes, badProbes atomic.Int64
	var lastBad atomic.Value
	probeCtx, stopProbe := context.WithCancel(ctx)
	var bg sync.WaitGroup
	bg.Add(1)
	go func() {
		defer bg.Done()
		for probeCtx.Err() == nil {
			if msg := p.probeJobs(probeCtx, tenantOf); probeCtx.Err() == nil {
				probes.Add(1)
				if msg != "" {
					badProbes.Add(1)
					lastBad.Store(msg)
				}
			}
			pause(probeCtx, 20*time.Millisecond)
		}
	}()
	// The writer: updates and soft deletes in every tenant, until stopped.
	writer := func() func() {
		wctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() {
			for salt := 1; wctx.Err() == nil; salt++ {
				if _, err := demo.Mutate(wctx, p.pool, 100, 1000, salt+int(time.Now().UnixNano()%1000)); err != nil && wctx.Err() == nil {
					done <- err
					return
				}
				pause(wctx, 150*time.Millisecond)
			}
			done <- nil
		}()
		return func() {
			cancel()
			require.NoError(t, <-done)
		}
	}
	cutover := func(cmd, job, want string) {
		t.Helper()
		c := testproc.Run(t, 4*time.Minute, p.indexerBin, p.env(), cmd, "--job", job, "--wait", "3m")
		require.Equal(t, 0, c.ExitCode(), "%s --job %s:\n%s\n%s\n%s", cmd, job, c.Stdout(), tail(c.Stderr(), 20), procs())
		require.Contains(t, c.Stdout(), "reads job "+job)
		require.Contains(t, c.Stdout(), "from "+want)
	}

	// 1. articles rebuilt at v2 while every job's rows change and the
	// other jobs' runs carry their changes; then the catch-up and the
	// cutover of articles, the writer still writing.
	stop := writer()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		runJobs(map[string]string{"notes": "v1", "memos": "v1"})
	}()
	run(jobs[0], "v2")
	wg.Wait()
	runsOK()
	step1 := map[string]string{"articles": "v2", "notes": "v1", "memos": "v1"}
	runJobs(step1) // the catch-up of articles, the others' latest changes
	runsOK()
	// The writer goes on through the cutover: what it changes after the
	// catch-up is in flight, carried by the next runs.
	cutover("cutover", "articles", v2)
	stop()
	runJobs(step1)
	runsOK()
	expectFound(step1)
	requireWriteAlias(t, p, v1) // notes and memos are live in v1: the write alias stays

	// The others keep changing after the cutover; their runs reach v1,
	// which searches still read for them.
	stop = writer()
	pause(ctx, time.Second)
	stop()
	runJobs(step1)
	runsOK()
	expectFound(step1)

	// 2. rollback of articles, after its job ran at v1 again (a declared
	// rebuild: v1 was live before and is not now, so a plain run at v1
	// is the stale schedule the batcher refuses).
	run(jobs[0], "v1", "--rebuild")
	cutover("rollback", "articles", v1)
	expectFound(allV1)
	requireAliasOn(t, p, v1)

	// 3. notes upgraded the same way.
	stop = writer()
	wg.Add(1)
	go func() {
		defer wg.Done()
		runJobs(map[string]string{"articles": "v1", "memos": "v1"})
	}()
	run(jobs[1], "v2")
	wg.Wait()
	runsOK()
	step3 := map[string]string{"articles": "v1", "notes": "v2", "memos": "v1"}
	runJobs(step3)
	runsOK()
	cutover("cutover", "notes", v2)
	stop()
	runJobs(step3)
	runsOK()
	expectFound(step3)

	stopProbe()
	bg.Wait()
	require.Positive(t, probes.Load())
	require.Zerof(t, badProbes.Load(), "probes that missed a job's documents or found them twice, of %d; last: %v", probes.Load(), lastBad.Load())
	report(t, "%d jobs on one alias: %d searches during two upgrades, a rollback and the runs between, 0 missing or doubled", len(jobs), probes.Load())
}

func requireWriteAlias(t *testing.T, p *pipeline, idx string) {
	t.Helper()
	targets, err := index.AliasTargets(context.Background(), p.es, p.alias+"-write")
	require.NoError(t, err)
	require.Equal(t, []string{idx}, targets)
}

// probeJobs searches the read alias the way users do (no refresh) and
// counts what it finds per job (_aggregate_type), then reads from the
// source, per job, the rows with a title that are not soft-deleted (every
// one must be found: deletes committed before the count can only lower it)
// and all rows with a title (none may be found twice). It returns what was
// wrong, "" when nothing.
func (p *pipeline) probeJobs(ctx context.Context, tenantOf map[string]string) string {
	res, err := p.es.Search(p.alias).Size(0).TrackTotalHits(true).
		Aggregation("jobs", elastic.NewTermsAggregation().Field(sink.FieldAggregateType).Size(10)).Do(ctx)
	if err != nil {
		return err.Error()
	}
	found := map[string]int64{}
	if terms, ok := res.Aggregations.Terms("jobs"); ok {
		for _, b := range terms.Buckets {
			found[fmt.Sprint(b.Key)] = b.DocCount
		}
	}
	live, all := map[string]int64{}, map[string]int64{}
	rows, err := p.pool.Query(ctx, `SELECT tenant_id, count(*) FILTER (WHERE deleted_at IS NULL), count(*) FROM source_records WHERE payload->>'title' IS NOT NULL GROUP BY 1`)
	if err != nil {
		return err.Error()
	}
	for rows.Next() {
		var tenant string
		var l, a int64
		if err := rows.Scan(&tenant, &l, &a); err != nil {
			rows.Close()
			return err.Error()
		}
		live[tenantOf[tenant]] += l
		all[tenantOf[tenant]] += a
	}
	if err := rows.Err(); err != nil {
		return err.Error()
	}
	var bad []string
	for job, l := range live {
		if found[job] < l || found[job] > all[job] {
			bad = append(bad, fmt.Sprintf("%s: %d found, want %d..%d", job, found[job], l, all[job]))
		}
	}
	slices.Sort(bad)
	return strings.Join(bad, "; ")
}

// checkSearch reads every document the read alias finds and compares it
// with the source: each live row with a title found once, its title the
// normalization of its latest payload by the processor version live for
// its job (v1: trim; v2: trim and upper), _pv that version. "" when equal.
func (p *pipeline) checkSearch(ctx context.Context, tenantOf, live map[string]string) string {
	_, _ = p.es.Refresh(p.alias).Do(ctx)
	res, err := p.es.Search(p.alias).Size(10000).Do(ctx)
	if err != nil {
		return err.Error()
	}
	got := map[string]map[string]any{}
	for _, h := range res.Hits.Hits {
		if _, dup := got[h.Id]; dup {
			return "found twice: " + h.Id
		}
		var src map[string]any
		if err := json.Unmarshal(h.Source, &src); err != nil {
			return err.Error()
		}
		got[h.Id] = src
	}
	rows, err := p.pool.Query(ctx, `SELECT id::text, tenant_id, btrim(payload->>'title') FROM source_records WHERE deleted_at IS NULL AND payload->>'title' IS NOT NULL`)
	if err != nil {
		return err.Error()
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		var id, tenant, title string
		if err := rows.Scan(&id, &tenant, &title); err != nil {
			return err.Error()
		}
		n++
		job := tenantOf[tenant]
		pv := live[job]
		if pv == "v2" {
			title = strings.ToUpper(title)
		}
		doc, ok := got[id]
		switch {
		case !ok:
			return fmt.Sprintf("row %s (%s) not found", id, job)
		case doc[sink.FieldPV] != pv || doc[sink.FieldAggregateType] != job:
			return fmt.Sprintf("row %s (%s): _pv %v, _aggregate_type %v; want %s", id, job, doc[sink.FieldPV], doc[sink.FieldAggregateType], pv)
		case doc["title"] != title:
			return fmt.Sprintf("row %s (%s): title %q, want %q", id, job, doc["title"], title)
		}
	}
	if err := rows.Err(); err != nil {
		return err.Error()
	}
	if len(got) != n {
		return fmt.Sprintf("%d documents found for %d live rows", len(got), n)
	}
	return ""
}
