package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/failpoint"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
	"github.com/outboxrelay/outboxrelay/sink"
)

// A new normalizer reaches the index without searches ever breaking: the
// index is built at processor v1; v2 (titles upper-cased) is rebuilt into
// its own generation while a writer keeps updating and soft-deleting rows
// and a prober keeps searching the read alias; the batcher, a publisher and
// an indexer are SIGKILLed once each during the rebuild and restarted. After
// the writer stops, a catch-up run and the cutover, every live row's
// document is the v2 normalization of its latest version, deletes are
// absent, and reconcile finds no drift. Rollback is refused (v1 is stale);
// with --force it brings v1 back; a second cutover rolls forward again.
func TestNormalizerUpgradeWithCutover(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const rows = 20_000
	p := newPipeline(t, pipelineOptions{TopicPartitions: 3, Chunk: batch.ChunkSettings{Size: 500, Min: 500, Max: 500}})
	require.NoError(t, demo.Seed(ctx, p.pool, demo.SeedOptions{Rows: rows}))

	const session = "SESSION_TIMEOUT=6s"
	pubEnv := []string{"LOG_LEVEL=warn", "LEASE_TTL=2s", "POLL_INTERVAL=200ms"}
	ixEnv := []string{"LOG_LEVEL=warn", session, "HEARTBEAT_INTERVAL=1s", "FLUSH_INTERVAL=100ms"}
	pubs := []*testproc.Proc{p.startPublisher(pubEnv...), p.startPublisher(pubEnv...)}
	ixs := []*testproc.Proc{p.startIndexer(ixEnv...), p.startIndexer(ixEnv...)}
	var procsMu sync.Mutex
	procs := func() string {
		procsMu.Lock()
		defer procsMu.Unlock()
		var b strings.Builder
		for i, pr := range pubs {
			fmt.Fprintf(&b, "publisher %d:\n%s\n", i, tail(pr.Stderr(), 10))
		}
		for i, pr := range ixs {
			fmt.Fprintf(&b, "indexer %d:\n%s\n", i, tail(pr.Stderr(), 10))
		}
		return b.String()
	}
	p.runBatcher(3*time.Minute, "--lease-ttl", "3s")
	p.waitSettled(ctx, 3*time.Minute, procs)
	v1, v2 := index.GenerationIndex(p.alias, "v1"), index.GenerationIndex(p.alias, "v2")
	requireAliasOn(t, p, v1)

	// The prober searches the read alias the way users do, without
	// refreshing: every answer must hold every live document. The live
	// generation is always complete (v1, settled before the prober starts,
	// or a generation a cutover found complete), no row is inserted, and
	// the writer only updates and soft-deletes: so an answer holds at
	// least the rows, minus the quarantined ones (never indexed), minus
	// the rows soft-deleted by the time it came back. That count is read
	// from the source after the answer: every delete the answer can
	// reflect committed before it, so the bound never runs ahead (the
	// writer's own counters lag its commits).
	var quarantined int64
	require.NoError(t, p.pool.QueryRow(ctx, `SELECT count(DISTINCT source_id) FROM batch_quarantine WHERE resolved_at IS NULL`).Scan(&quarantined))
	var probes, badProbes atomic.Int64
	var lastBad atomic.Value
	probeCtx, stopProbe := context.WithCancel(ctx)
	var bg sync.WaitGroup
	bg.Add(1)
	go func() {
		defer bg.Done()
		for probeCtx.Err() == nil {
			res, err := p.es.Search(p.alias).Size(10).TrackTotalHits(true).Do(probeCtx)
			var softDeleted int64
			if err == nil {
				err = p.pool.QueryRow(probeCtx, `SELECT count(*) FROM source_records WHERE deleted_at IS NOT NULL`).Scan(&softDeleted)
			}
			if probeCtx.Err() != nil {
				return
			}
			probes.Add(1)
			switch want := rows - quarantined - softDeleted; {
			case err != nil:
				badProbes.Add(1)
				lastBad.Store(err.Error())
			case res.TotalHits() < want || len(res.Hits.Hits) != 10:
				badProbes.Add(1)
				lastBad.Store(fmt.Sprintf("%d hits, want at least %d (%d rows, %d quarantined, %d soft-deleted), %d returned",
					res.TotalHits(), want, rows, quarantined, softDeleted, len(res.Hits.Hits)))
			}
			pause(probeCtx, 20*time.Millisecond)
		}
	}()

	// The writer changes rows all through the rebuild; its error, if any,
	// fails the test once it is stopped.
	var updated, deleted atomic.Int64
	writeCtx, cancelWriter := context.WithCancel(ctx)
	writerDone := make(chan error, 1)
	stopWriter := func() error {
		cancelWriter()
		return <-writerDone
	}
	go func() {
		for salt := 1; writeCtx.Err() == nil; salt++ {
			c, err := demo.Mutate(writeCtx, p.pool, 500, 5000, salt)
			if writeCtx.Err() != nil {
				break
			}
			if err != nil {
				writerDone <- fmt.Errorf("writer, round %d: %w", salt, err)
				return
			}
			updated.Add(c.Updated)
			deleted.Add(c.Deleted)
			pause(writeCtx, 150*time.Millisecond)
		}
		writerDone <- nil
	}()
	defer cancelWriter()

	// v2: the title upper-cased.
	specV2 := p.spec
	specV2.ProcessorVersion = "v2"
	specV2.Document.Fields = append([]batch.Field(nil), p.spec.Document.Fields...)
	for i, f := range specV2.Document.Fields {
		if f.Name == "title" {
			specV2.Document.Fields[i].Transforms = []string{"trim", "upper"}
		}
	}
	b, err := json.Marshal(specV2)
	require.NoError(t, err)
	v2File := filepath.Join(t.TempDir(), "job-v2.json")
	require.NoError(t, os.WriteFile(v2File, b, 0o644))
	batcher := func(extra ...string) *testproc.Proc {
		return testproc.Start(t, p.batcherBin, p.env(extra...), "run", "--spec", v2File, "--lease-ttl", "3s")
	}

	// The batcher dies after its fifth chunk.
	bt := batcher(failpoint.EnvVar + "=batch.after_commit@5")
	waitOrDump(t, bt, 2*time.Minute)
	require.True(t, bt.Killed(), "batcher killed at the failpoint:\n%s", tail(bt.Stderr(), 20))
	early := testproc.Run(t, time.Minute, p.indexerBin, p.env(), "cutover", "--job", p.spec.Job)
	require.Equal(t, cli.ExitConflict, early.ExitCode(), "cutover of a half-built generation: %s", early.Stdout())
	require.Contains(t, early.Stderr(), "has not succeeded in every partition")
	requireAliasOn(t, p, v1)

	// The rebuild goes on; once the v2 generation fills, a publisher and
	// an indexer die and come back.
	bt = batcher()
	waitUntil(t, 2*time.Minute, "v2 generation receives documents", func() bool {
		n, err := p.es.Count(v2).Do(ctx)
		return err == nil && n >= 3000
	})
	building := testproc.Run(t, time.Minute, p.indexerBin, p.env(), "status")
	require.Equal(t, 0, building.ExitCode(), building.Stderr())
	require.Regexp(t, v1+`\s+v1\s+live\s`, building.Stdout())
	require.Regexp(t, v2+`\s+v2\s+building\s+\d+\s+\d+\s+\d+/\d+ normalized rows`, building.Stdout())
	procsMu.Lock()
	require.NoError(t, pubs[0].Signal(syscall.SIGKILL))
	require.NoError(t, ixs[0].Signal(syscall.SIGKILL))
	_ = pubs[0].Wait(time.Minute)
	_ = ixs[0].Wait(time.Minute)
	pubs[0], ixs[0] = p.startPublisher(pubEnv...), p.startIndexer(ixEnv...)
	procsMu.Unlock()
	waitOrDump(t, bt, 3*time.Minute)
	require.Equal(t, 0, bt.ExitCode(), "resumed v2 run:\n%s", tail(bt.Stderr(), 20))

	// Not ready while rows changed behind the scanner wait for the
	// catch-up. One more round of changes after the run makes sure some
	// did, whatever the writer's timing.
	require.NoError(t, stopWriter())
	require.Positive(t, updated.Load(), "rows updated during the rebuild")
	require.Positive(t, deleted.Load(), "rows soft-deleted during the rebuild")
	c, err := demo.Mutate(ctx, p.pool, 500, 5000, -1)
	require.NoError(t, err)
	require.Positive(t, c.Updated+c.Deleted)
	noCatchUp := testproc.Run(t, time.Minute, p.indexerBin, p.env(), "cutover", "--job", p.spec.Job)
	require.Equal(t, cli.ExitConflict, noCatchUp.ExitCode(), "cutover before the catch-up: %s", noCatchUp.Stdout())
	require.Regexp(t, `\d+ row\(s\) of public\.source_records changed after run \S+ read them`, noCatchUp.Stderr())
	require.Contains(t, noCatchUp.Stderr(), "the catch-up")
	requireAliasOn(t, p, v1)

	// Catch-up: the same spec again, a new run with a new boundary; only
	// rows whose source version changed yield events.
	bt = batcher()
	waitOrDump(t, bt, 3*time.Minute)
	require.Equal(t, 0, bt.ExitCode(), "catch-up run:\n%s", tail(bt.Stderr(), 20))

	cut := testproc.Run(t, 4*time.Minute, p.indexerBin, p.env(), "cutover", "--job", p.spec.Job, "--wait", "3m")
	require.Equal(t, 0, cut.ExitCode(), "cutover:\n%s\n%s\n%s", cut.Stdout(), tail(cut.Stderr(), 20), procs())
	require.Contains(t, cut.Stdout(), "from "+v2)
	requireAliasOn(t, p, v2)

	// The old schedule still runs the v1 spec: refused, naming the live
	// version; the checks below find normalized_records and the index
	// untouched (every row at v2, the index equal to the source).
	stale := testproc.Run(t, 2*time.Minute, p.batcherBin, p.env(), "run", "--spec", p.specFile)
	require.Equal(t, cli.ExitConflict, stale.ExitCode(), "the v1 schedule after the cutover: %s", stale.Stdout())
	require.Contains(t, stale.Stderr(), "job "+p.spec.Job+": processor version v1 was live before and is not now: v2 is live")

	// Every live row's document is the v2 normalization of its latest
	// version; deletes are tombstones, invisible through the read alias.
	var behind, wrong int64
	require.NoError(t, p.pool.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE n.source_id IS NULL OR n.source_version <> s.version OR n.deleted <> (s.deleted_at IS NOT NULL) OR n.processor_version <> 'v2'),
       count(*) FILTER (WHERE s.deleted_at IS NULL AND n.document->>'title' IS DISTINCT FROM upper(btrim(s.payload->>'title')))
FROM source_records s LEFT JOIN normalized_records n ON n.source = $1 AND n.source_id = s.id::text`, sourceName).Scan(&behind, &wrong))
	require.Zero(t, behind, "normalized rows behind their source row or not at v2")
	require.Zero(t, wrong, "normalized titles that are not the v2 normalization")
	// The index, by the independent oracle: every document through the
	// read alias (v2 now) is the v2 document of its row's latest version,
	// every soft-deleted row a tombstone, invisible.
	p.expect = expectV2
	idx := p.requireIndexMatchesSource(ctx, p.expect, time.Now().Add(time.Minute), procs)
	require.Positive(t, idx.Tombstones, "soft-deleted rows")

	rec := testproc.Run(t, 2*time.Minute, p.indexerBin, p.env(), "reconcile", "--job", p.spec.Job)
	require.Equal(t, 0, rec.ExitCode(), "reconcile:\n%s\n%s", rec.Stdout(), rec.Stderr())
	require.Contains(t, rec.Stdout(), "no drift")

	st := testproc.Run(t, time.Minute, p.indexerBin, p.env(), "status")
	require.Equal(t, 0, st.ExitCode(), st.Stderr())
	require.Regexp(t, v2+`\s+v2\s+live\s+\d+\s+\d+\s+\d+/\d+ normalized rows`, st.Stdout())
	require.Regexp(t, v1+`\s+v1\s+old \(kept for rollback\)`, st.Stdout())

	drop := testproc.Run(t, time.Minute, p.indexerBin, p.env(), "generations", "drop", "--index", v2)
	require.Equal(t, cli.ExitConflict, drop.ExitCode(), "the live generation is never dropped")
	require.Contains(t, drop.Stderr(), "is the live generation")

	// Rollback: refused, since v1 is stale for the job (its rows are at
	// v2 now, and changed since v1 last saw them); --force rolls back
	// anyway, logged and audited. The v1 generation answers again (titles
	// as v1 made them).
	rb := testproc.Run(t, time.Minute, p.indexerBin, p.env(), "rollback", "--job", p.spec.Job)
	require.Equal(t, cli.ExitConflict, rb.ExitCode(), "rollback to a stale generation: %s", rb.Stdout())
	require.Contains(t, rb.Stderr(), "not at processor version v1")
	requireAliasOn(t, p, v2)
	rb = testproc.Run(t, time.Minute, p.indexerBin, p.env(), "rollback", "--job", p.spec.Job, "--force")
	require.Equal(t, 0, rb.ExitCode(), rb.Stderr())
	require.Contains(t, rb.Stdout(), "from "+v1)
	require.Contains(t, rb.Stdout(), "forced past")
	var audited int
	require.NoError(t, p.pool.QueryRow(ctx, `SELECT count(*) FROM checkpoint_audit WHERE job = $1 AND action = 'rollback-forced'`, p.spec.Job).Scan(&audited))
	require.Equal(t, 1, audited)
	requireAliasOn(t, p, v1)
	// After the rollback the v2 schedule is the stale one.
	stale = testproc.Run(t, 2*time.Minute, p.batcherBin, p.env(), "run", "--spec", v2File)
	require.Equal(t, cli.ExitConflict, stale.ExitCode(), "the v2 schedule after the rollback: %s", stale.Stdout())
	require.Contains(t, stale.Stderr(), "processor version v2 was live before and is not now: v1 is live")
	require.Equal(t, "v1", sampleDoc(t, p)[sink.FieldPV])
	title := sampleDoc(t, p)["title"].(string)
	require.NotEqual(t, strings.ToUpper(title), title, "a v1 title is not upper-cased")

	// Roll forward again.
	fwd := testproc.Run(t, 2*time.Minute, p.indexerBin, p.env(), "cutover", "--job", p.spec.Job)
	require.Equal(t, 0, fwd.ExitCode(), "%s\n%s", fwd.Stdout(), fwd.Stderr())
	requireAliasOn(t, p, v2)
	title = sampleDoc(t, p)["title"].(string)
	require.Equal(t, strings.ToUpper(title), title, "a v2 title is upper-cased")
	p.requireIndexMatchesSource(ctx, expectV2, time.Now().Add(time.Minute), procs)

	stopProbe()
	bg.Wait()
	require.Positive(t, probes.Load())
	require.Zerof(t, badProbes.Load(), "failed or short searches of %d; last: %v", probes.Load(), lastBad.Load())

	// The old generation can go; a rollback to it is refused afterwards.
	drop = testproc.Run(t, time.Minute, p.indexerBin, p.env(), "generations", "drop", "--index", v1)
	require.Equal(t, 0, drop.ExitCode(), drop.Stderr())
	rb = testproc.Run(t, time.Minute, p.indexerBin, p.env(), "rollback", "--job", p.spec.Job)
	require.Equal(t, cli.ExitConflict, rb.ExitCode(), rb.Stdout())
	require.Contains(t, rb.Stderr(), "no longer exists")
	report(t, "normalizer upgrade: %d rows, %d updates and %d soft deletes during the rebuild, %d searches during rebuild, cutover, rollback and roll-forward, 0 failed or short",
		rows, updated.Load(), deleted.Load(), probes.Load())
}

func requireAliasOn(t *testing.T, p *pipeline, idx string) {
	t.Helper()
	for _, a := range []string{p.alias, p.alias + "-write"} {
		targets, err := index.AliasTargets(context.Background(), p.es, a)
		require.NoError(t, err)
		require.Equal(t, []string{idx}, targets, "alias %s", a)
	}
}

// sampleDoc returns one live document through the read alias.
func sampleDoc(t *testing.T, p *pipeline) map[string]any {
	t.Helper()
	res, err := p.es.Search(p.alias).Size(1).Do(context.Background())
	require.NoError(t, err)
	require.Len(t, res.Hits.Hits, 1)
	var src map[string]any
	require.NoError(t, json.Unmarshal(res.Hits.Hits[0].Source, &src))
	return src
}

// waitOrDump waits for the process to exit (the caller checks how); one
// still running after timeout is made to print its goroutines (SIGQUIT)
// into the failure.
func waitOrDump(t *testing.T, pr *testproc.Proc, timeout time.Duration) {
	t.Helper()
	select {
	case <-pr.Done():
		return
	case <-time.After(timeout):
	}
	_ = pr.Signal(syscall.SIGQUIT)
	_ = pr.Wait(10 * time.Second)
	t.Fatalf("%s still running after %s:\n%s", pr.Cmd.Path, timeout, tail(pr.Stderr(), 200))
}

func waitUntil(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		require.Truef(t, time.Now().Before(deadline), "%s: not within %s", what, timeout)
		pause(context.Background(), 100*time.Millisecond)
	}
}
