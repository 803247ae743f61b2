package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/olivere/elastic/v7"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
	"github.com/outboxrelay/outboxrelay/outbox"
	"github.com/outboxrelay/outboxrelay/reconcile"
	"github.com/outboxrelay/outboxrelay/sink"
)

// pipeline is one isolated copy of the whole system for a test: its own
// database, topic, consumer group and index aliases on the shared servers,
// and the three real binaries.
type pipeline struct {
	tb       testing.TB
	dbURL    string
	pool     *pgxpool.Pool
	es       *elastic.Client
	brokers  []string
	topic    string
	group    string
	alias    string
	specFile string
	spec     batch.Spec
	// searchURLs: the engine the oracle reads over a client of its own.
	searchURLs []string
	// expect: what the oracle expects in the index (waitSettled).
	expect expectation

	batcherBin, publisherBin, indexerBin string
}

type pipelineOptions struct {
	// TopicPartitions of the topic. Default 6.
	TopicPartitions int
	// PartitionBy is the spec's source.partition ("" = one partition).
	PartitionBy string
	// Chunk overrides the demo spec's chunk settings when its Size is set.
	Chunk batch.ChunkSettings
}

const sourceName = "source_records"

func newPipeline(tb testing.TB, o pipelineOptions) *pipeline {
	tb.Helper()
	p := &pipeline{
		tb:           tb,
		dbURL:        stack.Database(tb),
		brokers:      stack.KafkaBrokers(tb),
		topic:        stack.UniqueName("e2e"),
		alias:        stack.UniqueName("e2e"),
		batcherBin:   testproc.Build(tb, "batcher"),
		publisherBin: testproc.Build(tb, "publisher"),
		indexerBin:   testproc.Build(tb, "indexer"),
		searchURLs:   []string{stack.ElasticsearchURL(tb)},
		expect:       expectV1,
	}
	p.group = p.topic + "-indexer"
	p.pool = stack.Pool(tb, p.dbURL)
	var err error
	p.es, err = index.NewClient(stack.ElasticsearchURL(tb))
	require.NoError(tb, err)
	createTopic(tb, p.brokers, p.topic, cmpOr(o.TopicPartitions, 6))

	spec, err := batch.LoadSpec(filepath.Join(stack.RepoRoot(), "demo", "job.yaml"))
	require.NoError(tb, err)
	spec.Topic = p.topic
	// The demo's root fields, without its comments relation: the oracle's
	// expected documents (oracle_test.go) are the root row's; relations
	// have their own end-to-end tests (random_relations_test.go,
	// relations_test.go).
	spec.Document.Relations = nil
	spec.Source.Partition = o.PartitionBy
	if o.Chunk.Size > 0 {
		spec.Chunk = o.Chunk
	}
	p.spec = spec
	b, err := json.MarshalIndent(spec, "", "  ")
	require.NoError(tb, err)
	p.specFile = filepath.Join(tb.TempDir(), "job.json")
	require.NoError(tb, os.WriteFile(p.specFile, b, 0o644))
	tb.Cleanup(func() {
		// Indices are the only thing on the shared servers that costs memory
		// until deleted; topics are small.
		_, _ = p.es.DeleteIndex(p.alias + "_v*").Do(context.Background())
	})
	return p
}

func cmpOr(v, def int) int {
	if v == 0 {
		return def
	}
	return v
}

func createTopic(tb testing.TB, brokers []string, topic string, partitions int) {
	tb.Helper()
	c := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 30 * time.Second}
	res, err := c.CreateTopics(context.Background(), &kafka.CreateTopicsRequest{
		Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: partitions, ReplicationFactor: 1}},
	})
	require.NoError(tb, err)
	for _, e := range res.Errors {
		require.NoError(tb, e)
	}
}

// env is what every process of this pipeline reads; extra settings ("K=V")
// come after and win.
func (p *pipeline) env(extra ...string) []string {
	base := []string{
		"DATABASE_URL=" + p.dbURL,
		"KAFKA_BROKERS=" + strings.Join(p.brokers, ","),
		"ELASTICSEARCH_URL=" + stack.ElasticsearchURL(p.tb),
		"TOPIC=" + p.topic,
		"GROUP=" + p.group,
		"ALIAS=" + p.alias,
		"METRICS_ADDR=",
		"PROGRESS=off",
		"LOG_FORMAT=json",
	}
	return append(base, extra...)
}

func (p *pipeline) startPublisher(extra ...string) *testproc.Proc {
	return testproc.Start(p.tb, p.publisherBin, p.env(extra...), "run")
}

func (p *pipeline) startIndexer(extra ...string) *testproc.Proc {
	return testproc.Start(p.tb, p.indexerBin, p.env(extra...), "run")
}

// runBatcher runs one `batcher run` to its end and requires exit 0.
func (p *pipeline) runBatcher(timeout time.Duration, extra ...string) *testproc.Proc {
	p.tb.Helper()
	b := testproc.Run(p.tb, timeout, p.batcherBin, p.env(extra...), "run", "--spec", p.specFile)
	require.Equal(p.tb, 0, b.ExitCode(), "batcher run:\n%s", tail(b.Stderr(), 30))
	return b
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func (p *pipeline) reconcileConfig() reconcile.Config {
	return reconcile.Config{DB: p.pool, Search: p.es, Index: p.alias + "-write", Source: sourceName, Topic: p.topic}
}

func (p *pipeline) outboxBacklog(ctx context.Context) int64 {
	var n int64
	require.NoError(p.tb, p.pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event_members`).Scan(&n))
	return n
}

// A broker may answer a request about a young topic with a transient error
// (CI saw ListOffsets fail with [-1] Unknown right after the topic's
// first records): the status is asked again for up to 30 s.
func (p *pipeline) status(ctx context.Context) (*sink.Status, error) {
	for deadline := time.Now().Add(30 * time.Second); ; {
		st, err := sink.GetStatus(ctx, sink.Config{Brokers: p.brokers, Topic: p.topic, Group: p.group})
		if err == nil || ctx.Err() != nil || time.Now().After(deadline) {
			return st, err
		}
		pause(ctx, 250*time.Millisecond)
	}
}

// settled is what waitSettled saw when the pipeline came to rest.
type settled struct {
	Report   reconcile.Report
	Drained  time.Duration // outbox empty
	Caught   time.Duration // consumer lag zero as well
	Matching time.Duration // reconcile clean as well
	Index    *indexCheck   // the oracle's passed check (nil from settle)
}

// waitSettled waits until the pipeline has come to rest (settle), then
// gives the verdict by the independent oracle: the whole index against the
// documents computed from the source by the test's own SQL (p.expect),
// checked again until the deadline if it differs.
func (p *pipeline) waitSettled(ctx context.Context, timeout time.Duration, procs func() string) settled {
	p.tb.Helper()
	start := time.Now()
	s := p.settle(ctx, timeout, procs)
	s.Index = p.requireIndexMatchesSource(ctx, p.expect, start.Add(timeout), procs)
	return s
}

// settle waits until the outbox is empty, the consumer group has no lag
// and reconcile reports the index equal to normalized_records. Events in
// flight show up as drift, so a clean report only counts once the first
// two hold. It polls; every condition has a deadline. It is the wait, not
// the verdict: reconcile is the product's own view (ids, versions and
// deleted flags, not content); waitSettled adds the oracle.
func (p *pipeline) settle(ctx context.Context, timeout time.Duration, procs func() string) settled {
	p.tb.Helper()
	start := time.Now()
	deadline := start.Add(timeout)
	var s settled
	var last string
	for {
		require.Truef(p.tb, time.Now().Before(deadline), "pipeline did not settle within %s; last: %s\n%s", timeout, last, procs())
		backlog := p.outboxBacklog(ctx)
		if backlog > 0 {
			s.Drained, s.Caught = 0, 0
			last = fmt.Sprintf("outbox backlog %d", backlog)
			pause(ctx, 250*time.Millisecond)
			continue
		}
		if s.Drained == 0 {
			s.Drained = time.Since(start)
		}
		st, err := p.status(ctx)
		if err != nil || st.TotalLag() > 0 {
			last = fmt.Sprintf("consumer lag: %v %v", lagOf(st), err)
			pause(ctx, 250*time.Millisecond)
			continue
		}
		if s.Caught == 0 {
			s.Caught = time.Since(start)
		}
		// The index refreshes every second; a refresh now makes the last
		// bulk visible to the aggregations at once.
		_, _ = p.es.Refresh(p.alias + "-write").Do(ctx)
		rep, err := reconcile.Run(ctx, p.reconcileConfig())
		if err == nil && rep.Clean() {
			s.Report, s.Matching = rep, time.Since(start)
			return s
		}
		last = fmt.Sprintf("reconcile: err=%v missing=%d stale=%d extra=%d (first: %v %v %v)", err, rep.MissingCount, rep.StaleCount, rep.ExtraCount,
			first(rep.Missing), first(rep.Stale), first(rep.Extra))
		pause(ctx, 500*time.Millisecond)
	}
}

func first(ds []reconcile.Drift) any {
	if len(ds) == 0 {
		return nil
	}
	return ds[0]
}

func lagOf(st *sink.Status) int64 {
	if st == nil {
		return -1
	}
	return st.TotalLag()
}

// pause waits d (a poll interval between checks of a condition, not a
// synchronization).
func pause(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// indexDoc is one document as the index holds it.
type indexDoc struct {
	Version int64
	Source  map[string]any
}

// readIndex reads every document (tombstones included) through the write
// alias.
func (p *pipeline) readIndex(ctx context.Context) map[string]indexDoc {
	p.tb.Helper()
	out, err := p.tryReadIndex(ctx)
	require.NoError(p.tb, err)
	return out
}

// normalized is a normalized_records row.
type normalized struct {
	Version int64
	Deleted bool
	Doc     map[string]any
}

func (p *pipeline) readNormalized(ctx context.Context) map[string]normalized {
	p.tb.Helper()
	rows, err := p.pool.Query(ctx, `SELECT source_id, source_version, deleted, document FROM normalized_records WHERE source = $1`, sourceName)
	require.NoError(p.tb, err)
	out := map[string]normalized{}
	for rows.Next() {
		var id string
		var n normalized
		var doc []byte
		require.NoError(p.tb, rows.Scan(&id, &n.Version, &n.Deleted, &doc))
		if doc != nil {
			require.NoError(p.tb, json.Unmarshal(doc, &n.Doc))
		}
		out[id] = n
	}
	require.NoError(p.tb, rows.Err())
	return out
}

// userDoc strips the fields the indexer adds for reconcile.
func userDoc(src map[string]any) map[string]any {
	out := maps.Clone(src)
	delete(out, sink.FieldBucket)
	delete(out, sink.FieldIDV)
	delete(out, sink.FieldPV)
	delete(out, sink.FieldAggregateType)
	return out
}

// searchCount counts the documents users see through the read alias.
func (p *pipeline) searchCount(ctx context.Context, q elastic.Query) int64 {
	p.tb.Helper()
	_, err := p.es.Refresh(p.alias + "-write").Do(ctx)
	require.NoError(p.tb, err)
	s := p.es.Count(p.alias)
	if q != nil {
		s = s.Query(q)
	}
	n, err := s.Do(ctx)
	require.NoError(p.tb, err)
	return n
}

// badIDs are the source rows the demo normalizer refuses (no title).
func (p *pipeline) badIDs(ctx context.Context) []string {
	p.tb.Helper()
	rows, err := p.pool.Query(ctx, `SELECT id::text FROM source_records WHERE payload->>'title' IS NULL AND deleted_at IS NULL ORDER BY 1`)
	require.NoError(p.tb, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(p.tb, err)
	return ids
}

// quarantined are the ids of the job's open quarantine rows, over all runs.
func (p *pipeline) quarantined(ctx context.Context) []string {
	p.tb.Helper()
	rows, err := p.pool.Query(ctx, `SELECT DISTINCT source_id FROM batch_quarantine WHERE job = $1 AND resolved_at IS NULL ORDER BY 1`, p.spec.Job)
	require.NoError(p.tb, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(p.tb, err)
	return ids
}

// deadLetters counts the publisher's dead-letter rows and the indexer's
// dead-letter topic.
func (p *pipeline) deadLetters(ctx context.Context) (publisher, indexer int64) {
	p.tb.Helper()
	require.NoError(p.tb, p.pool.QueryRow(ctx, `SELECT count(*) FROM outbox_dead_letters`).Scan(&publisher))
	st, err := p.status(ctx)
	require.NoError(p.tb, err)
	return publisher, st.DeadLettered
}

// topicStats reads the whole topic and counts its records and the records
// whose ce_id was seen before (duplicates the publisher sent, e.g. after a
// crash between the broker's ack and the outbox delete).
func (p *pipeline) topicStats(ctx context.Context) (records, duplicates int64) {
	p.tb.Helper()
	st, err := p.status(ctx)
	require.NoError(p.tb, err)
	seen := map[string]struct{}{}
	for _, part := range st.Partitions {
		if part.End <= part.First {
			continue
		}
		// A Reader, not one connection's fetches: it fetches again after a
		// slow or empty response instead of failing the test.
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: p.brokers, Topic: p.topic, Partition: part.Partition, MaxWait: 250 * time.Millisecond, MaxBytes: 16 << 20})
		require.NoError(p.tb, r.SetOffset(part.First))
		for next := part.First; next < part.End; {
			rctx, cancel := context.WithTimeout(ctx, time.Minute)
			m, err := r.ReadMessage(rctx)
			cancel()
			require.NoError(p.tb, err, "read %s/%d at %d", p.topic, part.Partition, next)
			next = m.Offset + 1
			records++
			for _, h := range m.Headers {
				if h.Key == "ce_id" {
					if _, dup := seen[string(h.Value)]; dup {
						duplicates++
					}
					seen[string(h.Value)] = struct{}{}
				}
			}
		}
		require.NoError(p.tb, r.Close())
	}
	return records, duplicates
}

// assertIndexEqualsSource checks every document of the index against
// normalized_records and normalized_records against the source table:
// each live, well-formed source row is in the index at its latest version
// with the document the batcher made of its latest content; each
// soft-deleted row is a tombstone at its latest version and invisible
// through the read alias; malformed rows are exactly the quarantined ones.
// It returns the number of live documents.
func (p *pipeline) assertIndexEqualsSource(ctx context.Context) (live int64) {
	tb := p.tb
	tb.Helper()
	// normalized_records follows the source: latest version, deleted-ness
	// and the title the normalizer makes of the latest payload.
	var behind, wrongTitle, missing int64
	require.NoError(tb, p.pool.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE n.source_id IS NOT NULL AND (n.source_version <> s.version OR n.deleted <> (s.deleted_at IS NOT NULL))),
       count(*) FILTER (WHERE n.source_id IS NOT NULL AND s.deleted_at IS NULL AND n.document->>'title' IS DISTINCT FROM btrim(s.payload->>'title')),
       count(*) FILTER (WHERE n.source_id IS NULL AND (s.payload->>'title' IS NOT NULL OR s.deleted_at IS NOT NULL))
FROM source_records s LEFT JOIN normalized_records n ON n.source = $1 AND n.source_id = s.id::text`, sourceName).Scan(&behind, &wrongTitle, &missing))
	require.Zero(tb, behind, "normalized rows behind their source row")
	require.Zero(tb, wrongTitle, "normalized documents not made from the latest payload")
	require.Zero(tb, missing, "well-formed or deleted source rows without a normalized row")

	norm := p.readNormalized(ctx)
	idx := p.readIndex(ctx)
	require.Equal(tb, len(norm), len(idx), "documents in the index (tombstones included) vs normalized_records")
	var deleted []string
	for id, n := range norm {
		d, ok := idx[id]
		require.Truef(tb, ok, "id %s (version %d) is not in the index", id, n.Version)
		require.Equalf(tb, n.Version, d.Version, "id %s: index version", id)
		if n.Deleted {
			require.Equalf(tb, true, d.Source[sink.FieldDeleted], "id %s: deleted in the source, not a tombstone in the index", id)
			deleted = append(deleted, id)
			continue
		}
		live++
		require.Equalf(tb, n.Doc, userDoc(d.Source), "id %s: indexed document differs from normalized_records.document", id)
	}
	require.Equal(tb, live, p.searchCount(ctx, nil), "documents visible through the read alias")
	slices.Sort(deleted)
	for lo := 0; lo < len(deleted); lo += 10_000 {
		ids := deleted[lo:min(lo+10_000, len(deleted))]
		require.Zero(tb, p.searchCount(ctx, elastic.NewIdsQuery().Ids(ids...)), "soft-deleted rows found through the read alias")
	}
	require.Equal(tb, p.badIDs(ctx), p.quarantined(ctx), "quarantined ids")
	return live
}

func freeAddr(tb testing.TB) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(tb, err)
	defer ln.Close()
	return ln.Addr().String()
}

// scrapeCounter sums the series of a counter on a /metrics endpoint whose
// labels include want ("" = all); -1 when the endpoint does not answer.
func scrapeCounter(ctx context.Context, addr, name, want string) float64 {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return -1
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(io.LimitReader(resp.Body, 8<<20))
	if err != nil {
		return -1
	}
	var sum float64
	for _, m := range fams[name].GetMetric() {
		ok := want == ""
		for _, l := range m.GetLabel() {
			ok = ok || l.GetValue() == want
		}
		if ok {
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

// report prints a figure line to the test log and to stdout, so CI output
// shows it even without -v.
func report(tb testing.TB, format string, args ...any) {
	tb.Helper()
	tb.Logf(format, args...)
	fmt.Printf("%s: %s\n", tb.Name(), fmt.Sprintf(format, args...))
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// topicOrder is what readTopicOrder found.
type topicOrder struct {
	seen      map[string]map[int64]bool // versions per key
	dups      int                       // records whose key and version came before
	backwards []string                  // versions first seen after a newer one
}

// readTopicOrder reads every partition of topic from the start and checks
// per-key order: a resend after a lost ack repeats records the log already
// has, so a repeat may follow newer versions, but a version's FIRST
// appearance must never follow a newer one.
func readTopicOrder(ctx context.Context, t *testing.T, brokers []string, c *kafka.Client, topic string, partitions int) topicOrder {
	t.Helper()
	o := topicOrder{seen: map[string]map[int64]bool{}}
	for part := range partitions {
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: topic, Partition: part, MaxWait: 250 * time.Millisecond})
		end := partitionEnd(ctx, t, c, topic, part)
		last := map[string]int64{}
		for off := int64(0); off < end; {
			rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			m, err := r.ReadMessage(rctx)
			cancel()
			require.NoError(t, err, "partition %d offset %d", part, off)
			off = m.Offset + 1
			var v int64
			for _, h := range m.Headers {
				if h.Key == outbox.HeaderAggregateVersion {
					v, _ = strconv.ParseInt(string(h.Value), 10, 64)
				}
			}
			key := string(m.Key)
			if v < last[key] && !o.seen[key][v] {
				o.backwards = append(o.backwards, fmt.Sprintf("partition %d offset %d: key %s version %d after %d", part, m.Offset, key, v, last[key]))
			}
			if o.seen[key][v] {
				o.dups++
			}
			if o.seen[key] == nil {
				o.seen[key] = map[int64]bool{}
			}
			o.seen[key][v] = true
			last[key] = max(last[key], v)
		}
		require.NoError(t, r.Close())
	}
	return o
}

// createReplicatedTopic creates topic on a three-broker cluster, three
// replicas and min.insync.replicas 2 (one broker may die without losing an
// acknowledged record), and returns a client of the cluster.
func createReplicatedTopic(ctx context.Context, t *testing.T, brokers []string, topic string, partitions int) *kafka.Client {
	t.Helper()
	c := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 30 * time.Second}
	ct, err := c.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{
		Topic: topic, NumPartitions: partitions, ReplicationFactor: 3,
		ConfigEntries: []kafka.ConfigEntry{{ConfigName: "min.insync.replicas", ConfigValue: "2"}},
	}}})
	require.NoError(t, err)
	for _, e := range ct.Errors {
		require.NoError(t, e)
	}
	return c
}
