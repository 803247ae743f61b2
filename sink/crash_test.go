package sink

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// The indexer's two crash windows, hit on purpose: a real indexer process
// kills itself (SIGKILL) right after a bulk was written and before its
// offsets are committed (sink.after-bulk), or right after an offset commit
// (sink.after-commit). A restarted indexer without failpoints catches up.
// Checked over the test's own connections, against an oracle computed from
// what the test produced:
//
//   - at the crash: every message below the group's committed offsets is in
//     the index (a committed offset means "indexed"); after the bulk, the
//     index also holds versions that only messages above the committed
//     offsets carry (the window the restart has to replay);
//   - after the restart: a full scroll of the index (tombstones included)
//     is the latest version of every id, with its content, deletes staying
//     deleted although older upserts are replayed after them; the read
//     alias shows exactly the live ids; the committed offsets are the ends
//     of the partitions; and the restarted indexer counted exactly the
//     version conflicts that replaying from the committed offsets onto the
//     crash-time index gives (the replay happened, and was refused by
//     version, not applied).
func TestIndexerCrashAfterBulk(t *testing.T) {
	t.Parallel()
	testIndexerCrash(t, FailpointAfterBulk)
}

func TestIndexerCrashAfterCommit(t *testing.T) {
	t.Parallel()
	testIndexerCrash(t, FailpointAfterCommit)
}

// crashNth is the visit of the failpoint that kills: a few batches are
// resolved and committed before, most of the stream is still to come.
const crashNth = 4

func testIndexerCrash(t *testing.T, failpoint string) {
	bin := testproc.Build(t, "indexer")
	es := stack.ElasticsearchURL(t)
	const partitions = 6
	f := newFixture(t, es, es, partitions)
	recs := crashHistory(150)
	f.produce(recs...)
	want := latestPerID(recs)

	// The topic as a consumer reads it (partition, offset), over a new
	// connection: the oracle of the replay.
	onTopic := readTopic(t, f.cfg.Brokers, f.cfg.Topic, partitions)
	require.Len(t, onTopic, len(recs))

	env := []string{
		"KAFKA_BROKERS=" + strings.Join(f.cfg.Brokers, ","),
		"ELASTICSEARCH_URL=" + es,
		"TOPIC=" + f.cfg.Topic,
		"GROUP=" + f.cfg.Group,
		"ALIAS=" + f.cfg.Alias,
		"BATCH_SIZE=10", // dozens of batches: the crash hits the middle of the stream
		"FLUSH_INTERVAL=20ms",
		"SESSION_TIMEOUT=6s",
		"HEARTBEAT_INTERVAL=1s",
		"LOG_FORMAT=json",
	}
	start := time.Now()
	crashing := testproc.Start(t, bin, append(slices.Clone(env), "METRICS_ADDR=",
		fmt.Sprintf("OUTBOXRELAY_FAILPOINT=%s@%d", failpoint, crashNth)), "run")
	require.Error(t, crashing.Wait(3*time.Minute), "the indexer must die at the failpoint\n%s", crashing.Stderr())
	require.True(t, crashing.Killed(), "exit code %d, want death by SIGKILL:\n%s", crashing.ExitCode(), crashing.Stderr())
	require.Contains(t, crashing.Stderr(), "failpoint "+failpoint+": killing process")

	// Once the dead member has left the group nobody commits any more, and
	// a bulk the engine took before the kill is applied.
	t.Logf("killed after %s", time.Since(start))
	waitGroupEmpty(t, f, f.cfg.Group, time.Minute)
	t.Logf("group empty after %s", time.Since(start))
	committed := committedOffsets(t, f.cfg.Brokers, f.cfg.Topic, f.cfg.Group, partitions)
	atCrash := scrollIndex(t, es, f.cfg.Alias+"_v1")
	t.Logf("at the crash: %d of %d messages committed, %d ids in the index", committedCount(committed), len(onTopic), len(atCrash))
	require.Positive(t, committedCount(committed), "batches were committed before the crash")
	require.Less(t, committedCount(committed), int64(len(onTopic)), "the crash must hit the middle of the stream")

	// A committed offset means everything before it is indexed.
	beyond := 0 // versions in the index that only uncommitted messages carry
	for _, m := range onTopic {
		held, ok := atCrash[m.id]
		if m.offset < committed[m.partition] {
			require.True(t, ok && held.version >= m.version, "%s v%d at %d/%d is below the committed offset %d but not in the index (index: %+v)",
				m.id, m.version, m.partition, m.offset, committed[m.partition], held)
		} else if ok && held.version == m.version {
			beyond++
		}
	}
	t.Logf("at the crash: %d indexed versions are carried only by messages above the committed offsets", beyond)
	if failpoint == FailpointAfterBulk {
		require.Positive(t, beyond, "killed after a bulk, before its commit: the index must be ahead of the committed offsets")
	}

	// What the restart must count as conflicts: the messages from the
	// committed offsets on, applied in offset order onto the index as the
	// crash left it, each refused unless its version is above the id's.
	current := map[string]int64{}
	for id, d := range atCrash {
		current[id] = d.version
	}
	wantConflicts := 0
	for _, m := range onTopic { // in offset order per partition; an id lives on one partition
		if m.offset < committed[m.partition] {
			continue
		}
		if m.version <= current[m.id] {
			wantConflicts++
			continue
		}
		current[m.id] = m.version
	}

	metricsAddr := freeAddr(t)
	restarted := testproc.Start(t, bin, append(slices.Clone(env), "METRICS_ADDR="+metricsAddr), "run")
	eventually(t, 3*time.Minute, func() error {
		if restarted.ExitCode() != -1 {
			return fmt.Errorf("restarted indexer exited with %d:\n%s", restarted.ExitCode(), restarted.Stderr())
		}
		c := committedOffsets(t, f.cfg.Brokers, f.cfg.Topic, f.cfg.Group, partitions)
		ends := endOffsets(t, f.cfg.Brokers, f.cfg.Topic, partitions)
		for p := range partitions {
			if c[p] != ends[p] {
				return fmt.Errorf("partition %d: committed %d, end %d", p, c[p], ends[p])
			}
		}
		return nil
	})
	t.Logf("caught up after %s", time.Since(start))
	conflicts := scrapeDocs(t, metricsAddr, "conflict")
	require.NoError(t, restarted.Signal(syscall.SIGTERM))
	require.NoError(t, restarted.Wait(time.Minute), restarted.Stderr())
	require.Equal(t, wantConflicts, conflicts, "version conflicts of the restarted indexer (replayed or stale messages refused by version)")
	if failpoint == FailpointAfterBulk {
		require.GreaterOrEqual(t, conflicts, beyond, "the restart replayed what the killed indexer had written")
	}

	// The end state, read over new connections.
	got := scrollIndex(t, es, f.cfg.Alias+"_v1")
	require.Equal(t, want, got, "every document of the index (tombstones included)")
	var live []string
	for id, d := range want {
		if !d.deleted {
			live = append(live, id)
		}
	}
	slices.Sort(live)
	require.Equal(t, live, searchIDs(t, es, f.cfg.Alias), "ids a user finds through the read alias")
	ends := endOffsets(t, f.cfg.Brokers, f.cfg.Topic, partitions)
	require.Equal(t, ends, committedOffsets(t, f.cfg.Brokers, f.cfg.Topic, f.cfg.Group, partitions), "committed offsets at the end of the topic")
	require.Equal(t, int64(len(recs)), committedCount(ends))
}

// crashHistory is the events of n ids, the k-th events of all ids before
// any (k+1)-th, each (id, version) once. Some ids end deleted, some are
// deleted and created again, some get a stale (older, late) upsert after
// a newer upsert or after their delete: with version_type=external broken,
// a replay or a stale message would show as an older version or a deleted
// id come back.
func crashHistory(n int) []rec {
	hist := make([][]rec, n)
	for i := range n {
		id := fmt.Sprintf("c-%03d", i)
		up := func(v int64) rec { return upsert(id, v, fmt.Sprintf(`{"n":%d,"title":"%s v%d"}`, i*10+int(v), id, v)) }
		switch i % 6 {
		case 0: // updated twice
			hist[i] = []rec{up(1), up(2), up(3)}
		case 1: // deleted
			hist[i] = []rec{up(1), up(2), del(id, 3)}
		case 2: // deleted, then created again
			hist[i] = []rec{up(1), del(id, 2), up(3)}
		case 3: // a stale upsert after a newer one
			hist[i] = []rec{up(1), up(4), up(2)}
		case 4: // a stale upsert after the delete
			hist[i] = []rec{up(1), del(id, 3), up(2)}
		case 5: // deleted before its first upsert arrives, which is older
			hist[i] = []rec{del(id, 5), up(4)}
		}
	}
	var out []rec
	for k := 0; ; k++ {
		before := len(out)
		for _, h := range hist {
			if k < len(h) {
				out = append(out, h[k])
			}
		}
		if len(out) == before {
			return out
		}
	}
}

// indexed is one document as the test reads it from the index.
type indexed struct {
	version int64
	deleted bool
	source  string // JSON without the reconcile fields; tombstones: {"_deleted":true}
}

// latestPerID is the index a correct indexer leaves: each id's highest
// version, a tombstone when that is a delete.
func latestPerID(recs []rec) map[string]indexed {
	out := map[string]indexed{}
	for _, r := range recs {
		if have, ok := out[r.id]; ok && have.version >= r.version {
			continue
		}
		d := indexed{version: r.version, deleted: r.typ == "delete", source: r.doc}
		if d.deleted {
			d.source = `{"` + FieldDeleted + `":true}`
		}
		out[r.id] = d
	}
	for id, d := range out {
		d.source = canonicalJSON(d.source)
		out[id] = d
	}
	return out
}

func canonicalJSON(s string) string {
	var v any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		panic(fmt.Sprintf("%q: %v", s, err))
	}
	b, _ := json.Marshal(v) // keys sorted
	return string(b)
}

// onTopicMsg is one message of the topic where a consumer reads it.
type onTopicMsg struct {
	partition int
	offset    int64
	id        string
	version   int64
}

// readTopic reads every message of the topic, partition by partition in
// offset order, with a new connection.
func readTopic(t *testing.T, brokers []string, topic string, partitions int) []onTopicMsg {
	t.Helper()
	ends := endOffsets(t, brokers, topic, partitions)
	var out []onTopicMsg
	for p := range partitions {
		if ends[p] == 0 {
			continue
		}
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: topic, Partition: p, MaxWait: 100 * time.Millisecond})
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		for {
			m, err := r.FetchMessage(ctx)
			require.NoError(t, err, "partition %d", p)
			v, err := strconv.ParseInt(headerMap(m)[outbox.HeaderAggregateVersion], 10, 64)
			require.NoError(t, err)
			out = append(out, onTopicMsg{partition: p, offset: m.Offset, id: string(m.Key), version: v})
			if m.Offset == ends[p]-1 {
				break
			}
		}
		cancel()
		require.NoError(t, r.Close())
	}
	return out
}

// endOffsets returns each partition's high watermark, from a new client.
func endOffsets(t *testing.T, brokers []string, topic string, partitions int) map[int]int64 {
	t.Helper()
	c := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 10 * time.Second}
	reqs := make([]kafka.OffsetRequest, partitions)
	for p := range partitions {
		reqs[p] = kafka.LastOffsetOf(p)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := c.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: reqs}})
	require.NoError(t, err)
	out := map[int]int64{}
	for _, po := range res.Topics[topic] {
		require.NoError(t, po.Error)
		out[po.Partition] = po.LastOffset
	}
	require.Len(t, out, partitions)
	return out
}

// committedOffsets returns the group's committed offset of each partition
// (0 when none), from a new client.
func committedOffsets(t *testing.T, brokers []string, topic, group string, partitions int) map[int]int64 {
	t.Helper()
	c := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 10 * time.Second}
	ids := make([]int, partitions)
	for p := range partitions {
		ids[p] = p
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := c.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: ids}})
	require.NoError(t, err)
	require.NoError(t, res.Error)
	out := map[int]int64{}
	for _, p := range res.Topics[topic] {
		require.NoError(t, p.Error)
		out[p.Partition] = max(p.CommittedOffset, 0)
	}
	require.Len(t, out, partitions)
	return out
}

func committedCount(offsets map[int]int64) int64 {
	var n int64
	for _, o := range offsets {
		n += o
	}
	return n
}

// waitGroupEmpty waits until group has no member (a killed one is
// dropped after its session timeout).
func waitGroupEmpty(t *testing.T, f *fixture, group string, timeout time.Duration) {
	t.Helper()
	eventually(t, timeout, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		res, err := f.kclient.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: []string{group}})
		if err != nil {
			return err
		}
		if len(res.Groups) != 1 || res.Groups[0].GroupState != "Empty" {
			return fmt.Errorf("group %s: %+v", group, res.Groups)
		}
		return nil
	})
}

// scrollIndex reads every document of index (tombstones included) with a
// scroll over a new client, after a refresh.
func scrollIndex(t *testing.T, url, index string) map[string]indexed {
	t.Helper()
	client, err := elastic.NewSimpleClient(elastic.SetURL(url))
	require.NoError(t, err)
	ctx := context.Background()
	_, err = client.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodPost, Path: "/" + index + "/_refresh"})
	require.NoError(t, err)
	type page struct {
		ScrollID string `json:"_scroll_id"`
		Hits     struct {
			Hits []struct {
				ID      string          `json:"_id"`
				Version int64           `json:"_version"`
				Source  json.RawMessage `json:"_source"`
			} `json:"hits"`
		} `json:"hits"`
	}
	res, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method: http.MethodPost, Path: "/" + index + "/_search", Params: map[string][]string{"scroll": {"1m"}},
		Body: map[string]any{"size": 100, "sort": []string{"_doc"}, "version": true, "query": map[string]any{"match_all": map[string]any{}}},
	})
	require.NoError(t, err)
	out := map[string]indexed{}
	for {
		var pg page
		require.NoError(t, json.Unmarshal(res.Body, &pg))
		if len(pg.Hits.Hits) == 0 {
			_, _ = client.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodDelete, Path: "/_search/scroll", Body: map[string]any{"scroll_id": pg.ScrollID}})
			return out
		}
		for _, h := range pg.Hits.Hits {
			require.NotContains(t, out, h.ID, "scroll returned %s twice", h.ID)
			src := stripReconcileFields(t, h.ID, h.Version, h.Source) // checks _bucket and _idv
			var fields map[string]json.RawMessage
			require.NoError(t, json.Unmarshal(src, &fields))
			out[h.ID] = indexed{version: h.Version, deleted: string(fields[FieldDeleted]) == "true", source: canonicalJSON(string(src))}
		}
		res, err = client.PerformRequest(ctx, elastic.PerformRequestOptions{
			Method: http.MethodPost, Path: "/_search/scroll", Body: map[string]any{"scroll": "1m", "scroll_id": pg.ScrollID},
		})
		require.NoError(t, err)
	}
}

// searchIDs returns the sorted ids a search through alias finds.
func searchIDs(t *testing.T, url, alias string) []string {
	t.Helper()
	client, err := elastic.NewSimpleClient(elastic.SetURL(url))
	require.NoError(t, err)
	res, err := client.PerformRequest(context.Background(), elastic.PerformRequestOptions{
		Method: http.MethodPost, Path: "/" + alias + "/_search",
		Body: map[string]any{"size": 10000, "_source": false, "query": map[string]any{"match_all": map[string]any{}}},
	})
	require.NoError(t, err)
	var sr struct {
		Hits struct {
			Hits []struct {
				ID string `json:"_id"`
			} `json:"hits"`
		} `json:"hits"`
	}
	require.NoError(t, json.Unmarshal(res.Body, &sr))
	ids := make([]string, len(sr.Hits.Hits))
	for i, h := range sr.Hits.Hits {
		ids[i] = h.ID
	}
	slices.Sort(ids)
	return ids
}

// scrapeDocs reads indexer_docs_total{result} from a process's /metrics.
func scrapeDocs(t *testing.T, addr, result string) int {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(io.LimitReader(resp.Body, 8<<20))
	require.NoError(t, err)
	for _, m := range fams["indexer_docs_total"].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "result" && l.GetValue() == result {
				return int(m.GetCounter().GetValue())
			}
		}
	}
	return 0
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().String()
}
