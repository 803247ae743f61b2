// Command demo runs the whole outboxrelay pipeline on the local stack and
// shows it working: `make demo` (which starts the stack and builds the
// binaries first).
//
// It seeds source_records in a fresh database, runs batcher, publisher and
// indexer as separate processes, shows each stage's progress, waits until
// the index matches the source (reconciled by count and versions), prints a
// summary and a sample search, then changes and soft-deletes some rows,
// runs the next batcher run and shows the index following; last, it
// changes the normalizer (titles upper-cased, processor version v2),
// rebuilds every document into a new index generation while searches keep
// reading the old one, cuts the read alias over and searches the new
// documents. Ctrl-C stops everything it started.
//
// It is a demo of the local, plaintext stack only: its own connections
// (the topic it creates, the index it reads) use no TLS, SASL or search
// credentials, so it refuses to start when a Kafka or search security
// setting is in the environment rather than hand it to the binaries it
// starts and connect around it. See docs/secured-clusters.md for running
// the binaries against a secured cluster.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/segmentio/kafka-go"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/logging"
	"github.com/outboxrelay/outboxrelay/reconcile"
)

type config struct {
	rows      int
	binDir    string
	workDir   string
	database  string
	brokers   string
	searchURL string
	timeout   time.Duration
}

func main() {
	var c config
	flag.IntVar(&c.rows, "rows", envInt("ROWS", 200_000), "source rows to seed (env ROWS)")
	flag.StringVar(&c.binDir, "bin", "bin", "directory holding batcher, publisher and indexer")
	flag.StringVar(&c.workDir, "work", ".stack/demo", "directory for the demo's logs and spec")
	flag.DurationVar(&c.timeout, "timeout", 20*time.Minute, "give up after this long")
	flag.Parse()
	c.database = os.Getenv("DATABASE_URL")
	c.brokers = os.Getenv("KAFKA_BROKERS")
	c.searchURL = os.Getenv("ELASTICSEARCH_URL")
	if c.database == "" || c.brokers == "" || c.searchURL == "" {
		fmt.Fprintln(os.Stderr, "demo: DATABASE_URL, KAFKA_BROKERS and ELASTICSEARCH_URL must be set (make demo starts the stack and sets them)")
		os.Exit(2)
	}
	if set := securitySettings(os.Environ()); len(set) > 0 {
		fmt.Fprintf(os.Stderr, "demo: %s set: the demo runs on the local plaintext stack only; unset them (see docs/secured-clusters.md to run the binaries on a secured cluster)\n", strings.Join(set, ", "))
		os.Exit(2)
	}
	if c.rows <= 0 {
		fmt.Fprintf(os.Stderr, "demo: ROWS=%d: want a positive number\n", c.rows)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	d := &run{config: c, tty: logging.IsTerminal(os.Stdout)}
	err := d.main(ctx)
	d.stopAll()
	if err != nil {
		if errors.Is(ctx.Err(), context.Canceled) {
			fmt.Fprintln(os.Stderr, "\ndemo: interrupted; everything it started is stopped")
			os.Exit(130)
		}
		fmt.Fprintf(os.Stderr, "\ndemo: %v\n", err)
		os.Exit(1)
	}
}

// securitySettings returns the non-empty Kafka and search security
// settings, and the file forms of the URLs, in environ (names only).
func securitySettings(environ []string) []string {
	var set []string
	for _, kv := range environ {
		name, value, _ := strings.Cut(kv, "=")
		if value == "" {
			continue
		}
		switch {
		case strings.HasPrefix(name, "KAFKA_TLS"), strings.HasPrefix(name, "KAFKA_SASL_"),
			strings.HasPrefix(name, "ELASTICSEARCH_") && name != "ELASTICSEARCH_URL",
			name == "DATABASE_URL_FILE":
			set = append(set, name)
		}
	}
	slices.Sort(set)
	return set
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

type run struct {
	config
	tty      bool
	dbURL    string
	pool     *pgxpool.Pool
	es       *elastic.Client
	procs    []*exec.Cmd
	specFile string
	topic    string
	alias    string
	indexerM string // indexer metrics address
}

const job = "records"

func (d *run) main(ctx context.Context) error {
	start := time.Now()
	if err := os.MkdirAll(d.workDir, 0o755); err != nil {
		return err
	}
	stamp := strconv.FormatInt(time.Now().Unix(), 10)
	d.topic = "outboxrelay.demo." + stamp
	d.alias = "demo-records"

	fmt.Printf("outboxrelay demo: %d rows, PostgreSQL → batcher → outbox → publisher → Kafka → indexer → OpenSearch\n\n", d.rows)
	if err := d.setup(ctx); err != nil {
		return err
	}
	defer d.pool.Close()

	step("seed", "creating source_records with %d rows (every 10,000th row has no title and will be quarantined), every 3rd with two comments in record_comments (nested in its document)", d.rows)
	t := time.Now()
	err := demo.Seed(ctx, d.pool, demo.SeedOptions{Rows: d.rows, BadEvery: 10_000, CommentEvery: 3, Progress: func(done int) {
		d.line("  seeded %d/%d rows", done, d.rows)
	}})
	if err != nil {
		return err
	}
	d.endLine()
	fmt.Printf("  seeded %d rows in %s\n", d.rows, time.Since(t).Round(time.Millisecond))

	step("start", "publisher and indexer as separate processes (logs in %s)", d.workDir)
	pubAddr, ixAddr := freeAddr(), freeAddr()
	d.indexerM = ixAddr
	if err := d.startProc(ctx, "publisher", []string{"DATABASE_URL=" + d.dbURL, "KAFKA_BROKERS=" + d.brokers, "METRICS_ADDR=" + pubAddr, "LOG_FORMAT=json"}, "run"); err != nil {
		return err
	}
	if err := d.startProc(ctx, "indexer", []string{"DATABASE_URL=" + d.dbURL, "KAFKA_BROKERS=" + d.brokers, "ELASTICSEARCH_URL=" + d.searchURL, "TOPIC=" + d.topic,
		"GROUP=outboxrelay-demo-" + stamp, "ALIAS=" + d.alias, "METRICS_ADDR=" + ixAddr, "LOG_FORMAT=json"}, "run"); err != nil {
		return err
	}

	step("run 1", "batcher: full scan of source_records up to the boundary fixed at start")
	live := d.alias + "-write"
	engineUp, engineCPU := d.engineAge(ctx)
	first, err := d.pipelineRun(ctx, 1, d.specFile, live, "")
	if err != nil {
		return err
	}
	if engineUp > 0 && engineCPU < coldEngineCPU {
		fmt.Printf("  (the search engine started %s before this run and had used %s of CPU: it compiles its indexing code during its first documents, which makes this run slower than the same work on a warm engine; a second make demo on the same stack shows the difference)\n",
			engineUp.Round(time.Second), engineCPU.Round(time.Second))
	}
	if err := d.sampleSearch(ctx); err != nil {
		return err
	}

	step("change", "updating and soft-deleting some source rows")
	changes, err := demo.Mutate(ctx, d.pool, 100, 250, 7)
	if err != nil {
		return err
	}
	fmt.Printf("  %d rows updated (version + 1), %d rows soft-deleted\n", changes.Updated, changes.Deleted)
	var updatedID, deletedID string
	_ = d.pool.QueryRow(ctx, `SELECT id::text FROM source_records WHERE deleted_at IS NULL AND version > 1 ORDER BY id LIMIT 1`).Scan(&updatedID)
	_ = d.pool.QueryRow(ctx, `SELECT id::text FROM source_records WHERE deleted_at IS NOT NULL ORDER BY id LIMIT 1`).Scan(&deletedID)
	// A comment on a record whose own row does not change: its document
	// changes all the same, and so does its index version.
	var commentedID string
	err = d.pool.QueryRow(ctx, `
WITH r AS (SELECT s.id FROM source_records s WHERE s.deleted_at IS NULL AND s.version = 1 AND s.payload->>'title' IS NOT NULL
           AND EXISTS (SELECT FROM record_comments c WHERE c.record_id = s.id) ORDER BY s.id LIMIT 1),
gone AS (UPDATE record_comments c SET deleted_at = now() FROM r WHERE c.id = (SELECT min(id) FROM record_comments WHERE record_id = r.id) RETURNING 1),
i AS (INSERT INTO record_comments (record_id, author, body) SELECT r.id, 'demo', 'A new comment: the record row did not change' FROM r RETURNING 1)
SELECT r.id::text FROM r, i`).Scan(&commentedID)
	if err != nil {
		return fmt.Errorf("comment on a record: %w", err)
	}
	fmt.Printf("  record %s (its row unchanged): one comment soft-deleted, one comment added\n", commentedID)

	step("run 2", "batcher: the next run; unchanged rows produce no event, changed and deleted rows do")
	second, err := d.pipelineRun(ctx, 2, d.specFile, live, "")
	if err != nil {
		return err
	}
	if err := d.showFollowing(ctx, updatedID, deletedID, commentedID); err != nil {
		return err
	}

	third, err := d.newNormalizer(ctx)
	if err != nil {
		return err
	}

	q, dl := d.quarantineAndDeadLetters(ctx)
	fmt.Printf("\n== summary ==\n")
	fmt.Printf("  rows                      %d seeded, %d changed, %d soft-deleted\n", d.rows, changes.Updated, changes.Deleted)
	fmt.Printf("  run 1                     %s\n", first)
	fmt.Printf("  run 2                     %s\n", second)
	fmt.Printf("  run 3 (normalizer v2)     %s\n", third)
	fmt.Printf("  duplicates absorbed       %d (stale or replayed messages the index refused by version)\n", d.metric(ctx, "indexer_docs_total", "conflict"))
	fmt.Printf("  quarantined               %d rows (batcher quarantine list)\n", q)
	fmt.Printf("  dead-lettered             %d (publisher + indexer)\n", dl)
	fmt.Printf("  total demo time           %s\n", time.Since(start).Round(time.Millisecond))
	fmt.Printf("\nSearch it yourself: curl '%s/%s/_search?q=title:kafka&size=3&pretty'\n", d.searchURL, d.alias)
	printNextSteps(os.Stdout)
	return nil
}

// nextSteps are the pages a demo user reads next, the first one the
// walk-through with a table of their own.
var nextSteps = [][2]string{
	{"your own table, step by step", "docs/getting-started.md"},
	{"job specs: fields, transforms, relations", "docs/job-specs.md"},
	{"follow changes continuously, deletes", "docs/following-changes.md"},
	{"run it in production", "docs/operating.md"},
}

// printNextSteps tells where to go from the demo.
func printNextSteps(w io.Writer) {
	fmt.Fprintf(w, "\n== where to go next ==\n")
	for _, s := range nextSteps {
		fmt.Fprintf(w, "  %-42s %s\n", s[0], s[1])
	}
	fmt.Fprintf(w, "  (README.md lists every page; make demo-down stops the stack)\n")
}

func step(name, format string, args ...any) {
	fmt.Printf("\n== %s == %s\n", name, fmt.Sprintf(format, args...))
}

// line shows a progress line: rewritten in place on a terminal, printed
// every few seconds otherwise.
var lastPlain time.Time

func (d *run) line(format string, args ...any) {
	s := fmt.Sprintf(format, args...)
	if d.tty {
		fmt.Printf("\r\033[K%s", s)
		return
	}
	if time.Since(lastPlain) >= 3*time.Second {
		fmt.Println(s)
		lastPlain = time.Now()
	}
}

func (d *run) endLine() {
	if d.tty {
		fmt.Print("\r\033[K")
	}
}

func (d *run) setup(ctx context.Context) error {
	step("setup", "fresh database outboxrelay_demo, index alias %s, topic %s", d.alias, d.topic)
	admin, err := pgx.Connect(ctx, d.database)
	if err != nil {
		return fmt.Errorf("connect to DATABASE_URL: %w", err)
	}
	defer admin.Close(ctx)
	for _, q := range []string{`DROP DATABASE IF EXISTS outboxrelay_demo WITH (FORCE)`, `CREATE DATABASE outboxrelay_demo`} {
		if _, err := admin.Exec(ctx, q); err != nil {
			return fmt.Errorf("%s: %w", q, err)
		}
	}
	u, err := urlWithDatabase(d.database, "outboxrelay_demo")
	if err != nil {
		return err
	}
	d.dbURL = u
	if out, err := d.binary(ctx, "batcher", []string{"DATABASE_URL=" + d.dbURL}, "migrate").CombinedOutput(); err != nil {
		return fmt.Errorf("batcher migrate: %v\n%s", err, out)
	}
	if d.pool, err = pgxpool.New(ctx, d.dbURL); err != nil {
		return err
	}
	if d.es, err = index.NewClient(d.searchURL); err != nil {
		return err
	}
	// A previous demo's index and aliases go, so the counts start at zero.
	if _, err := d.es.DeleteIndex(d.alias + "_v*").Do(ctx); err != nil && !elastic.IsNotFound(err) {
		return fmt.Errorf("remove the previous demo index: %w", err)
	}
	if err := createTopic(d.brokers, d.topic, 6); err != nil {
		return err
	}
	spec, err := batch.LoadSpec("demo/job.yaml")
	if err != nil {
		return err
	}
	spec.Topic = d.topic
	b, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return err
	}
	d.specFile = filepath.Join(d.workDir, "job.json")
	return os.WriteFile(d.specFile, b, 0o644)
}

func urlWithDatabase(base, name string) (string, error) {
	u, err := url.Parse(base)
	if err != nil || u.Scheme == "" {
		return "", fmt.Errorf("DATABASE_URL must be a URL such as postgres://user@host:5432/db")
	}
	u.Path = "/" + name
	return u.String(), nil
}

func (d *run) binary(ctx context.Context, name string, env []string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, filepath.Join(d.binDir, name), args...)
	cmd.Env = append(os.Environ(), env...)
	return cmd
}

func (d *run) startProc(ctx context.Context, name string, env []string, args ...string) error {
	logf, err := os.Create(filepath.Join(d.workDir, name+".log"))
	if err != nil {
		return err
	}
	cmd := exec.Command(filepath.Join(d.binDir, name), args...) // outlives ctx: stopped by stopAll
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Its own process group keeps a Ctrl-C on the terminal from reaching it
	// before the demo asks it to stop; Pdeathsig stops it if the demo dies
	// without asking (killed, or its `go run` parent interrupted).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", name, err)
	}
	d.procs = append(d.procs, cmd)
	fmt.Printf("  %s running (pid %d)\n", name, cmd.Process.Pid)
	return nil
}

// stopAll asks every process to stop (SIGTERM), then kills what is left.
func (d *run) stopAll() {
	for _, p := range d.procs {
		_ = p.Process.Signal(syscall.SIGTERM)
	}
	for _, p := range d.procs {
		done := make(chan struct{})
		go func() { _ = p.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			_ = p.Process.Kill()
			<-done
		}
	}
	d.procs = nil
}

func freeAddr() string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return ""
	}
	defer ln.Close()
	return ln.Addr().String()
}

// newNormalizer is the third act: the title transform becomes [trim,
// upper] under processor version v2; the batcher rebuilds every document
// into the generation demo-records_v2 while searches keep reading v1; then
// indexer cutover moves the read alias in one action.
func (d *run) newNormalizer(ctx context.Context) (string, error) {
	spec, err := batch.LoadSpec(d.specFile)
	if err != nil {
		return "", err
	}
	spec.ProcessorVersion = "v2"
	for i, f := range spec.Document.Fields {
		if f.Name == "title" {
			spec.Document.Fields[i].Transforms = []string{"trim", "upper"}
		}
	}
	b, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return "", err
	}
	v2File := filepath.Join(d.workDir, "job-v2.json")
	if err := os.WriteFile(v2File, b, 0o644); err != nil {
		return "", err
	}
	gen := index.GenerationIndex(d.alias, "v2")
	step("normalizer", "a new normalizer: title transforms [trim] -> [trim, upper], processor_version v1 -> v2 (%s)", v2File)
	step("run 3", "batcher: every row normalized again and indexed into the new generation %s; searches keep reading %s", gen, index.GenerationIndex(d.alias, "v1"))
	res, err := d.pipelineRun(ctx, 3, v2File, gen, "v2")
	if err != nil {
		return "", err
	}
	if err := d.sampleSearch(ctx); err != nil {
		return "", err
	}
	fmt.Println("  (still the v1 documents: the read alias has not moved)")

	step("cutover", "indexer cutover --job %s: checks the v2 run, normalized_records and the new generation, then moves both aliases in one call", job)
	t0 := time.Now()
	out, err := d.binary(ctx, "indexer", []string{"DATABASE_URL=" + d.dbURL, "ELASTICSEARCH_URL=" + d.searchURL, "ALIAS=" + d.alias, "LOG_FORMAT=json"},
		"cutover", "--job", job, "--wait", "2m").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("indexer cutover: %v\n%s", err, out)
	}
	fmt.Printf("  %s  (took %s)\n", strings.TrimSpace(string(out)), time.Since(t0).Round(time.Millisecond))
	if err := d.sampleSearch(ctx); err != nil {
		return "", err
	}
	fmt.Printf("  rollback in one action: indexer rollback --job %s --force (ALIAS=%s; without --force, after batcher run --rebuild at v1); then indexer generations drop --index %s when done\n", job, d.alias, index.GenerationIndex(d.alias, "v1"))
	return res, nil
}

// pipelineRun runs the batcher once with specFile and waits until index
// matches normalized_records (reconciled; pv: the expected processor
// version, "" for any), showing each stage's progress.
func (d *run) pipelineRun(ctx context.Context, n int, specFile, index, pv string) (string, error) {
	t0 := time.Now()
	logf, err := os.Create(filepath.Join(d.workDir, fmt.Sprintf("batcher-run%d.log", n)))
	if err != nil {
		return "", err
	}
	defer logf.Close()
	b := d.binary(ctx, "batcher", []string{"DATABASE_URL=" + d.dbURL, "METRICS_ADDR=", "PROGRESS=off", "LOG_FORMAT=json"}, "run", "--spec", specFile)
	b.Stdout, b.Stderr = logf, logf
	b.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := b.Start(); err != nil {
		return "", fmt.Errorf("start batcher: %w", err)
	}
	batchDone := make(chan error, 1)
	go func() { batchDone <- b.Wait() }()

	var batchEnd, drainedAt time.Time
	var processed, changed, total int64
	var gate lagGate
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case err := <-batchDone:
			if err != nil {
				return "", fmt.Errorf("batcher run failed: %v (log: %s)", err, logf.Name())
			}
			batchEnd = time.Now()
			batchDone = nil
		case <-tick.C:
		}
		_ = d.pool.QueryRow(ctx, `SELECT coalesce(sum(processed_count), 0), coalesce(sum(changed_count), 0), coalesce(sum(estimated_total), 0)
FROM batch_runs WHERE job = $1 AND logical_run_id = (SELECT logical_run_id FROM batch_runs WHERE job = $1 ORDER BY created_at DESC LIMIT 1)`, job).Scan(&processed, &changed, &total)
		var backlog int64
		_ = d.pool.QueryRow(ctx, `SELECT coalesce(sum(coalesce(cardinality(group_ids), 1)), 0) FROM outbox_events`).Scan(&backlog) // an event group counts its events
		written, searchable := d.indexed(ctx, index)
		state := "running"
		if !batchEnd.IsZero() {
			state = "done"
		}
		rate := float64(processed) / time.Since(t0).Seconds()
		d.line("  batcher %d/%d rows (%s, %.0f rows/s) | outbox backlog %d | index %d written, %d searchable", processed, max(total, processed), state, rate, backlog, written, searchable)
		if batchEnd.IsZero() || backlog > 0 {
			continue
		}
		if drainedAt.IsZero() {
			drainedAt = time.Now()
		}
		if lag, ok := d.metricSum(ctx, "indexer_consumer_lag", ""); gate.hold(lag, ok, time.Now()) {
			continue
		}
		rep, err := reconcile.Run(ctx, reconcile.Config{DB: d.pool, Search: d.es, Index: index, Source: "source_records", ProcessorVersion: pv})
		if err == nil && rep.Clean() {
			d.endLine()
			indexedAt := time.Now()
			fmt.Printf("  batcher   %d rows read, %d changed in %s (%.0f rows/s)\n", processed, changed, batchEnd.Sub(t0).Round(time.Millisecond), float64(processed)/batchEnd.Sub(t0).Seconds())
			fmt.Printf("  publisher outbox drained %s after the start (%.0f events/s end to end)\n", drainedAt.Sub(t0).Round(time.Millisecond), float64(changed)/drainedAt.Sub(t0).Seconds())
			fmt.Printf("  indexer   index matches the source %s after the start: %d documents reconciled (%.0f docs/s end to end)\n", indexedAt.Sub(t0).Round(time.Millisecond), rep.SourceRows, float64(changed)/indexedAt.Sub(t0).Seconds())
			return fmt.Sprintf("%d rows read, %d events, index matched after %s", processed, changed, indexedAt.Sub(t0).Round(time.Millisecond)), nil
		}
	}
}

// lagStuck is how long the indexer's lag may stay the same above 0 before
// the demo reconciles all the same.
const lagStuck = 5 * time.Second

// lagGate holds reconcile back while the indexer is behind: reconciling
// then would scroll every bucket that still differs, taking the engine's
// CPU from the indexing it waits for. The lag is the indexer's own (as of
// its last fetch; reconcile has the last word), and one that stops moving
// (the gauge is set after each commit, and a failed commit leaves it) holds
// reconcile back for lagStuck at most.
type lagGate struct {
	last  float64
	since time.Time
}

// hold reports whether to wait, given the lag read at now (ok: the indexer
// exported it).
func (g *lagGate) hold(lag float64, ok bool, now time.Time) bool {
	if !ok || lag == 0 {
		g.last = 0
		return false
	}
	if lag != g.last {
		g.last, g.since = lag, now
	}
	return now.Sub(g.since) < lagStuck
}

// indexed returns what the engine wrote into index (index operations,
// searchable or not: while a new generation is bulk-loaded its refresh is
// off, and nothing is searchable until the load ends) and what a search
// counts now.
func (d *run) indexed(ctx context.Context, index string) (written, searchable int64) {
	if st, err := d.es.IndexStats(index).Metric("indexing").Do(ctx); err == nil && st.All != nil && st.All.Primaries != nil && st.All.Primaries.Indexing != nil {
		written = st.All.Primaries.Indexing.IndexTotal
	}
	return written, d.count(ctx, index)
}

// coldEngineCPU: an engine that has used less CPU than this since it
// started has not compiled its indexing code yet. Measured
// (docs/benchmarks.md): a fresh engine spends about three times the CPU
// on its first 200,000 documents; it starts with about 10 CPU-seconds, and
// one whole demo adds about 60.
const coldEngineCPU = 45 * time.Second

// engineAge returns how long the search engine's youngest node has been
// running and how much CPU it has used, or zeros when the engine does not
// say.
func (d *run) engineAge(ctx context.Context) (up, cpu time.Duration) {
	st, err := d.es.NodesStats().Metric("jvm", "process").Do(ctx)
	if err != nil {
		return 0, 0
	}
	for _, n := range st.Nodes {
		if n.JVM == nil || n.JVM.UptimeInMillis <= 0 || n.Process == nil {
			continue
		}
		if u := time.Duration(n.JVM.UptimeInMillis) * time.Millisecond; up == 0 || u < up {
			up, cpu = u, time.Duration(n.Process.CPU.TotalInMillis)*time.Millisecond
		}
	}
	return up, cpu
}

// count returns the documents in index (tombstones included).
func (d *run) count(ctx context.Context, index string) int64 {
	n, err := d.es.Count(index).Do(ctx)
	if err != nil {
		return 0
	}
	return n
}

func (d *run) sampleSearch(ctx context.Context) error {
	fmt.Printf("\n  sample search through the read alias %s: title:kafka\n", d.alias)
	res, err := d.es.Search(d.alias).Query(elastic.NewMatchQuery("title", "kafka")).Size(3).Version(true).TrackTotalHits(true).Do(ctx)
	if err != nil {
		return fmt.Errorf("sample search: %w", err)
	}
	fmt.Printf("  %d hits; the first %d:\n", res.TotalHits(), len(res.Hits.Hits))
	for _, h := range res.Hits.Hits {
		var doc struct {
			Title string   `json:"title"`
			Tags  []string `json:"tags"`
		}
		_ = json.Unmarshal(h.Source, &doc)
		fmt.Printf("    _id=%-8s _version=%d title=%q tags=%v\n", h.Id, derefVersion(h.Version), doc.Title, doc.Tags)
	}
	return nil
}

func derefVersion(v *int64) int64 {
	if v == nil {
		return 0
	}
	return *v
}

func (d *run) showFollowing(ctx context.Context, updatedID, deletedID, commentedID string) error {
	if updatedID != "" {
		res, err := d.es.Search(d.alias).Query(elastic.NewIdsQuery().Ids(updatedID)).Version(true).Do(ctx)
		if err != nil {
			return err
		}
		for _, h := range res.Hits.Hits {
			var doc struct {
				Title string `json:"title"`
			}
			_ = json.Unmarshal(h.Source, &doc)
			fmt.Printf("  updated row %s: the index now has _version=%d title=%q\n", updatedID, derefVersion(h.Version), doc.Title)
		}
	}
	if deletedID != "" {
		res, err := d.es.Search(d.alias).Query(elastic.NewIdsQuery().Ids(deletedID)).Do(ctx)
		if err != nil {
			return err
		}
		fmt.Printf("  soft-deleted row %s: %d hits through the read alias (a versioned tombstone keeps it deleted)\n", deletedID, res.TotalHits())
	}
	if commentedID != "" {
		res, err := d.es.Search(d.alias).Query(elastic.NewIdsQuery().Ids(commentedID)).Version(true).Do(ctx)
		if err != nil {
			return err
		}
		for _, h := range res.Hits.Hits {
			var doc struct {
				Comments []struct {
					Author string `json:"author"`
					Body   string `json:"body"`
				} `json:"comments"`
			}
			_ = json.Unmarshal(h.Source, &doc)
			fmt.Printf("  commented record %s: the index now has _version=%d (its row is still at version 1) with %d comments:\n", commentedID, derefVersion(h.Version), len(doc.Comments))
			for _, c := range doc.Comments {
				fmt.Printf("    %s: %q\n", c.Author, c.Body)
			}
		}
		q := elastic.NewMatchPhraseQuery("comments.body", "the record row did not change")
		hits, err := d.es.Search(d.alias).Query(q).Size(0).Do(ctx)
		if err != nil {
			return err
		}
		fmt.Printf("  search comments.body:\"the record row did not change\": %d hit(s)\n", hits.TotalHits())
	}
	return nil
}

func (d *run) quarantineAndDeadLetters(ctx context.Context) (quarantined, deadLettered int64) {
	_ = d.pool.QueryRow(ctx, `SELECT count(DISTINCT source_id) FROM batch_quarantine WHERE job = $1`, job).Scan(&quarantined)
	var pub int64
	_ = d.pool.QueryRow(ctx, `SELECT count(*) FROM outbox_dead_letters`).Scan(&pub)
	return quarantined, pub + d.metric(ctx, "indexer_dead_lettered_total", "")
}

// metric reads a counter from the indexer's /metrics (summed over the
// series whose labels contain want, or all when want is "").
func (d *run) metric(ctx context.Context, name, want string) int64 {
	sum, _ := d.metricSum(ctx, name, want)
	return int64(sum)
}

// metricSum reads a counter or a gauge from the indexer's /metrics, summed
// as metric does; ok is false when the indexer did not export it.
func (d *run) metricSum(ctx context.Context, name, want string) (sum float64, ok bool) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+d.indexerM+"/metrics", nil)
	if err != nil {
		return 0, false
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, false
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(io.LimitReader(resp.Body, 8<<20))
	if err != nil {
		return 0, false
	}
	fam, ok := families[name]
	if !ok {
		return 0, false
	}
	for _, m := range fam.GetMetric() {
		match := want == ""
		for _, l := range m.GetLabel() {
			match = match || l.GetValue() == want
		}
		if match {
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum, true
}

// createTopic creates the demo's topic with enough partitions for the
// indexer's lanes to work in parallel.
func createTopic(brokers, topic string, partitions int) error {
	conn, err := kafka.Dial("tcp", strings.Split(brokers, ",")[0])
	if err != nil {
		return fmt.Errorf("connect to KAFKA_BROKERS: %w", err)
	}
	defer conn.Close()
	ctrl, err := conn.Controller()
	if err != nil {
		return fmt.Errorf("find the Kafka controller: %w", err)
	}
	cc, err := kafka.Dial("tcp", net.JoinHostPort(ctrl.Host, strconv.Itoa(ctrl.Port)))
	if err != nil {
		return fmt.Errorf("connect to the Kafka controller: %w", err)
	}
	defer cc.Close()
	if err := cc.CreateTopics(kafka.TopicConfig{Topic: topic, NumPartitions: partitions, ReplicationFactor: 1}); err != nil {
		return fmt.Errorf("create topic %s: %w", topic, err)
	}
	return nil
}
