package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/batch"
	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// The whole pipeline on a 3-broker Kafka cluster (replication 3,
// min.insync.replicas 2) and a 2-node OpenSearch cluster (one replica), the
// indexer given both nodes' URLs. While a batcher run publishes and indexes,
// the leader broker of a busy partition is SIGKILLed, then the search node
// that holds the index's primary shard; both come back, and a second run
// publishes updates and deletes. In the end the index equals
// normalized_records (reconcile), every document is at its source row's
// latest version (no stale document, deletes are tombstones), per-key order
// holds on every partition, nothing is dead-lettered, and the cluster is
// green again.
func TestPipelineSurvivesBrokerAndSearchNodeFailover(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	started := time.Now()

	phase := func(what string) { t.Logf("+%s %s", time.Since(started).Round(100*time.Millisecond), what) }

	// Both clusters at once, while the binaries build: each takes a minute
	// or more on a busy machine.
	var kc, sc *stack.Server
	var kOK, sOK bool
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); kOK = startCluster(t, "kafka-cluster", &kc) }()
	go func() { defer wg.Done(); sOK = startCluster(t, "search-cluster", &sc) }()
	t.Cleanup(func() {
		wg.Wait() // a start still under way when the test failed
		// Both at once (a purge waits for each JVM to exit), then the state
		// dirs, through which the scripts find their processes.
		var purge sync.WaitGroup
		for _, c := range []*stack.Server{kc, sc} {
			if c != nil {
				purge.Add(1)
				go func() { defer purge.Done(); _ = c.Purge(); _ = os.RemoveAll(c.Dir) }()
			}
		}
		purge.Wait()
	})
	p := newPipeline(t, pipelineOptions{
		TopicPartitions: 1,
		// Small chunks: the run publishes for a while, in many commits.
		Chunk: batch.ChunkSettings{Size: 500, Min: 200, Max: 2000, TargetDuration: batch.Duration(300 * time.Millisecond)},
	})
	const rows, updated, deleted = 20_000, 2_000, 500
	require.NoError(t, demo.Seed(ctx, p.pool, demo.SeedOptions{Rows: rows}))
	phase("binaries built, source seeded")
	wg.Wait()
	require.True(t, kOK && sOK, "a cluster did not start")
	brokers := strings.Split(kc.Env, ",")
	require.Len(t, index.SplitURLs(sc.Env), 2, "search cluster URLs")
	clustersUp := time.Since(started)
	phase("clusters up")
	p.brokers = brokers
	es, err := index.NewClient(sc.Env)
	require.NoError(t, err)
	p.es = es
	p.searchURLs = index.SplitURLs(sc.Env)
	const partitions = 3
	kcl := createReplicatedTopic(ctx, t, brokers, p.topic, partitions)

	metrics := freeAddr(t)
	pub := p.startPublisher("LOG_LEVEL=warn", "BATCH_SIZE=200")
	// A rate cap keeps the indexer busy for the run's length, so the search
	// node dies in the middle of indexing, not after it.
	ix := p.startIndexer("LOG_LEVEL=warn", "ELASTICSEARCH_URL="+sc.Env, "METRICS_ADDR="+metrics, "BATCH_SIZE=250", "MAX_RATE=1500")
	procs := func() string { return "publisher:\n" + tail(pub.Stderr(), 20) + "\nindexer:\n" + tail(ix.Stderr(), 20) }

	// The indexer creates the index (one shard, one replica) at start. Its
	// primary is moved to node 2, the node without the cluster-manager role,
	// so that killing node 2 fails the primary over to node 1's replica.
	var idx string
	waitFor(t, 2*time.Minute, "the indexer to create the index", func() bool {
		targets, err := index.AliasTargets(ctx, p.es, p.alias+"-write")
		if err == nil && len(targets) == 1 {
			idx = targets[0]
		}
		return idx != ""
	})
	waitGreen(ctx, t, p.es, idx, 2*time.Minute)
	if primaryNode(ctx, t, p.es, idx) != "outboxrelay-node-2" {
		_, err := p.es.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodPost, Path: "/_cluster/reroute",
			Body: map[string]any{"commands": []any{map[string]any{"cancel": map[string]any{
				"index": idx, "shard": 0, "node": "outboxrelay-node-1", "allow_primary": true}}}}})
		require.NoError(t, err, "move the primary to node 2")
		waitFor(t, 2*time.Minute, "the primary on node 2", func() bool { return primaryNode(ctx, t, p.es, idx) == "outboxrelay-node-2" })
		waitGreen(ctx, t, p.es, idx, 2*time.Minute)
	}

	phase("index created, primary on node 2, green")
	run1 := testproc.Start(t, p.batcherBin, p.env(), "run", "--spec", p.specFile)

	// The leader broker of partition 0, once records flow.
	waitFor(t, 2*time.Minute, "records on the topic", func() bool { return endOffsets(ctx, t, kcl, p.topic, partitions) > 0 })
	md, err := kcl.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{p.topic}})
	require.NoError(t, err)
	leader := md.Topics[0].Partitions[0].Leader.ID
	broker := &stack.Server{Kind: "kafka", Dir: filepath.Join(kc.Dir, "kafka-cluster", "node-"+strconv.Itoa(leader))}
	pubInFlight := p.outboxBacklog(ctx)
	before := endOffsets(ctx, t, kcl, p.topic, partitions)
	brokerKilled := time.Now()
	killPidFile(t, filepath.Join(broker.Dir, "kafka", "kafka.pid"))
	waitFor(t, 2*time.Minute, "publishing to resume after the broker kill", func() bool {
		return endOffsets(ctx, t, kcl, p.topic, partitions) > before+500
	}, procs)
	pubResumed := time.Since(brokerKilled)
	phase(fmt.Sprintf("broker %d killed, publishing resumed", leader))

	// Search node 2 (the primary), once a good part of the run is indexed
	// and more waits on the topic.
	var ixInFlight int64
	waitFor(t, 2*time.Minute, "indexing under way with messages waiting", func() bool {
		// Green too: a replica that fell behind under load (marked stale
		// by its primary, recovering) cannot take over, and the shard
		// would go red instead of failing over.
		st, err := p.status(ctx)
		if err != nil || docCount(ctx, p.es, idx) < 2000 || indexHealth(ctx, p.es, idx) != "green" {
			return false
		}
		ixInFlight = st.TotalLag()
		return ixInFlight > 0
	}, procs)
	node := &stack.Server{Kind: "opensearch", Dir: filepath.Join(sc.Dir, "search-cluster", "node-2"),
		Vars: []string{"SEARCH_JAVA_OPTS=-Xms512m -Xmx512m", "SEARCH_START_TIMEOUT=240"}}
	// Counts after a refresh: what is written, not what the last periodic
	// refresh showed.
	atKill := docCount(ctx, p.es, idx)
	nodeKilled := time.Now()
	killPidFile(t, filepath.Join(node.Dir, "opensearch", "opensearch.pid"))
	last := atKill
	waitFor(t, 2*time.Minute, "indexing to resume on node 1 after the node kill", func() bool {
		last = docCount(ctx, p.es, idx)
		return last > atKill+500
	}, func() string {
		return fmt.Sprintf("documents: %d at the kill, %d last (-1: the count failed)\n%s\n%s", atKill, last, clusterState(ctx, p.es, idx), procs())
	})
	ixResumed := time.Since(nodeKilled)
	phase("search node 2 killed, indexing resumed")

	// Both come back while the run goes on.
	var brokerErr, nodeErr error
	wg.Add(2)
	go func() { defer wg.Done(); brokerErr = broker.Start() }()
	go func() { defer wg.Done(); nodeErr = node.Start() }()
	wg.Wait()
	require.NoError(t, brokerErr, "restart broker %d", leader)
	require.NoError(t, nodeErr, "restart search node 2")
	phase("broker and search node back")
	require.NoError(t, run1.Wait(3*time.Minute), "batcher run 1:\n%s", tail(run1.Stderr(), 30))
	require.Equal(t, 0, run1.ExitCode(), "batcher run 1:\n%s", tail(run1.Stderr(), 30))

	// A second run publishes updates and deletes on top, while node 2's
	// copy recovers.
	_, err = p.pool.Exec(ctx, `UPDATE source_records SET payload = payload || jsonb_build_object('title', 'Edited ' || id) WHERE id IN (SELECT id FROM source_records ORDER BY id LIMIT $1)`, updated)
	require.NoError(t, err)
	_, err = p.pool.Exec(ctx, `UPDATE source_records SET deleted_at = clock_timestamp() WHERE id IN (SELECT id FROM source_records ORDER BY id DESC LIMIT $1)`, deleted)
	require.NoError(t, err)
	p.runBatcher(3 * time.Minute)
	phase("second run done")

	s := p.waitSettled(ctx, 3*time.Minute, procs)
	phase("settled: outbox drained, no lag, reconcile clean")
	// Node 2's copy recovers while the checks read (green is waited on last).
	live := p.assertIndexEqualsSource(ctx)
	require.EqualValues(t, rows-deleted, live)
	pubDL, ixDL := p.deadLetters(ctx)
	require.Zero(t, pubDL, "publisher dead letters caused by the leader change")
	require.Zero(t, ixDL, "indexer dead letters")
	order := readTopicOrder(ctx, t, brokers, kcl, p.topic, partitions)
	require.Len(t, order.seen, rows, "keys on the topic")
	conflicts := scrapeCounter(ctx, metrics, "indexer_docs_total", "conflict")
	phase("checked")
	waitGreen(ctx, t, p.es, "", 2*time.Minute)
	phase("cluster green")

	report(t, "broker %d SIGKILLed with %d events in the outbox, publishing resumed %s later; search node 2 (primary) SIGKILLed with %d messages unindexed, indexing resumed %s later; "+
		"%d duplicate records on the topic, %.0f stale or duplicate writes absorbed by the index; settled %s after the last run; clusters up in %s, test %s",
		leader, pubInFlight, pubResumed.Round(time.Millisecond), ixInFlight, ixResumed.Round(time.Millisecond),
		order.dups, conflicts, s.Matching.Round(time.Millisecond), clustersUp.Round(time.Second), time.Since(started).Round(time.Second))
	require.Zerof(t, len(order.backwards), "versions first seen after a newer one; first: %s", strings.Join(order.backwards[:min(5, len(order.backwards))], "; "))
}

// startCluster starts a private cluster (kafka-cluster or search-cluster)
// into *srv (set before the start, so that the caller can purge a half
// started one). It reports an error and returns false instead of failing
// the test, so it may run on another goroutine.
func startCluster(t *testing.T, kind string, srv **stack.Server) bool {
	dir, err := os.MkdirTemp("", "outboxrelay-"+kind+"-")
	if err != nil {
		t.Errorf("%s: %v", kind, err)
		return false
	}
	*srv = &stack.Server{Kind: kind, Dir: dir}
	if err := (*srv).Start(); err != nil {
		t.Errorf("start %s: %v", kind, err)
		return false
	}
	return true
}

// killPidFile SIGKILLs the process whose pid the file holds.
func killPidFile(t *testing.T, file string) {
	t.Helper()
	b, err := os.ReadFile(file)
	require.NoError(t, err)
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	require.NoError(t, err)
	require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
}

// waitGreen waits on _cluster/health?wait_for_status=green (of one index,
// or of the cluster when index is ""), within d.
func waitGreen(ctx context.Context, t *testing.T, es *elastic.Client, index string, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	var last string
	for time.Now().Before(deadline) {
		path := "/_cluster/health"
		if index != "" {
			path += "/" + url.PathEscape(index)
		}
		res, err := es.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodGet, Path: path,
			Params: url.Values{"wait_for_status": {"green"}, "timeout": {"10s"}}, IgnoreErrors: []int{http.StatusRequestTimeout}})
		if err == nil {
			var h struct {
				Status   string `json:"status"`
				TimedOut bool   `json:"timed_out"`
			}
			if json.Unmarshal(res.Body, &h) == nil && h.Status == "green" && !h.TimedOut {
				return
			}
			last = string(res.Body)
		} else {
			last = err.Error() // a node that just died: the client goes to the other one
		}
	}
	require.FailNowf(t, "cluster not green", "%s waiting for green health of %q; last answer: %s", d, index, last)
}

// indexHealth is index's health status now ("green", "yellow", "red"), or
// "" when the engine does not answer.
func indexHealth(ctx context.Context, es *elastic.Client, index string) string {
	res, err := es.ClusterHealth().Index(index).Do(ctx)
	if err != nil {
		return ""
	}
	return res.Status
}

// clusterState is index's health and shard table, for a failure message.
func clusterState(ctx context.Context, es *elastic.Client, index string) string {
	var out strings.Builder
	for path, params := range map[string]url.Values{
		"/_cluster/health/" + url.PathEscape(index): nil,
		"/_cat/shards/" + url.PathEscape(index):     {"format": {"json"}, "h": {"shard,prirep,state,docs,node,unassigned.reason"}},
	} {
		res, err := es.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodGet, Path: path, Params: params})
		if err != nil {
			fmt.Fprintf(&out, "GET %s: %v\n", path, err)
			continue
		}
		fmt.Fprintf(&out, "GET %s:\n%s\n", path, res.Body)
	}
	return out.String()
}

// primaryNode names the node that holds shard 0's primary of index.
func primaryNode(ctx context.Context, t *testing.T, es *elastic.Client, index string) string {
	t.Helper()
	res, err := es.PerformRequest(ctx, elastic.PerformRequestOptions{Method: http.MethodGet, Path: "/_cat/shards/" + url.PathEscape(index),
		Params: url.Values{"format": {"json"}, "h": {"shard,prirep,state,node"}}})
	if err != nil {
		return ""
	}
	var shards []struct{ Shard, Prirep, State, Node string }
	require.NoError(t, json.Unmarshal(res.Body, &shards))
	for _, s := range shards {
		if s.Shard == "0" && s.Prirep == "p" && s.State == "STARTED" {
			return s.Node
		}
	}
	return ""
}

// docCount refreshes index and counts its documents (tombstones
// included); -1 when the engine does not answer.
func docCount(ctx context.Context, es *elastic.Client, index string) int64 {
	if _, err := es.Refresh(index).Do(ctx); err != nil {
		return -1
	}
	n, err := es.Count(index).Do(ctx)
	if err != nil {
		return -1
	}
	return n
}
