package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/index"
	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/sink"
)

type purgeFixture struct {
	brokers             []string
	esURL, alias, topic string
	index               string
	client              *elastic.Client
}

// newPurgeFixture makes an index with a tombstone written two hours ago
// ("old") and one written now ("new"), and a topic whose oldest record is
// from now.
func newPurgeFixture(t *testing.T) *purgeFixture {
	ctx := context.Background()
	f := &purgeFixture{brokers: stack.KafkaBrokers(t), esURL: stack.ElasticsearchURL(t)}
	var err error
	f.client, err = index.NewClient(f.esURL)
	require.NoError(t, err)
	f.alias, f.topic = stack.UniqueName("purge"), stack.UniqueName("purge")
	t.Cleanup(func() { _, _ = f.client.DeleteIndex(f.alias + "_*").Do(context.Background()) })
	f.index, err = index.Ensure(ctx, f.client, f.alias, f.alias+"-write", sink.DefaultMapping)
	require.NoError(t, err)

	kc := &kafka.Client{Addr: kafka.TCP(f.brokers...), Timeout: 30 * time.Second}
	_, err = kc.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: f.topic, NumPartitions: 1, ReplicationFactor: -1}}})
	require.NoError(t, err)
	w := &kafka.Writer{Addr: kafka.TCP(f.brokers...), Topic: f.topic, RequiredAcks: kafka.RequireAll}
	t.Cleanup(func() { _ = w.Close() })
	require.Eventually(t, func() bool { // the partition's leader is elected a moment after creation
		return w.WriteMessages(ctx, kafka.Message{Key: []byte("z"), Value: []byte(`{}`)}) == nil
	}, 30*time.Second, 100*time.Millisecond)

	for id, at := range map[string]time.Time{"old": time.Now().Add(-2 * time.Hour), "new": time.Now()} {
		_, err := f.client.PerformRequest(ctx, elastic.PerformRequestOptions{
			Method: http.MethodPut, Path: "/" + f.alias + "-write/_doc/" + id,
			Params: map[string][]string{"version": {"2"}, "version_type": {"external"}, "refresh": {"true"}},
			Body:   fmt.Sprintf(`{"_deleted":true,"_deleted_at":%d}`, at.UnixMilli()),
		})
		require.NoError(t, err)
	}
	return f
}

func (f *purgeFixture) exists(t *testing.T, id string) bool {
	ok, err := f.client.Exists().Index(f.alias + "-write").Id(id).Do(context.Background())
	require.NoError(t, err)
	return ok
}

// indexer tombstones purge prints the horizon and the source bounding it,
// counts with --dry-run, and then deletes exactly the tombstones before
// the horizon (margin one minute).
func TestTombstonesPurgeCommand(t *testing.T) {
	ctx := context.Background()
	f := newPurgeFixture(t)
	brokers, esURL, alias, topic, index := f.brokers, f.esURL, f.alias, f.topic, f.index
	exists := func(id string) bool { return f.exists(t, id) }
	run := func(args ...string) string {
		var stdout, stderr bytes.Buffer
		args = append([]string{"tombstones", "purge", "--kafka-brokers", brokers[0], "--topic", topic, "--elasticsearch-url", esURL,
			"--alias", alias, "--database-url", stack.Database(t), "--tombstone-purge-margin", "1m"}, args...)
		cmds := commands()
		for i, c := range cmds {
			if c.Name == "tombstones purge" {
				cmds[i] = purgeCommand(&stdout)
			}
		}
		code := cli.Dispatch(ctx, "indexer", "test", cmds, args, &stdout, &stderr)
		require.Equal(t, 0, code, stderr.String())
		return stdout.String()
	}
	// An index only named like a generation (not made by the indexer)
	// with a document that looks like an old tombstone: not touched.
	foreign := alias + "_archive"
	_, err := f.client.PerformRequest(ctx, elastic.PerformRequestOptions{
		Method: http.MethodPut, Path: "/" + foreign + "/_doc/old", Params: map[string][]string{"refresh": {"true"}},
		Body: fmt.Sprintf(`{"_deleted":true,"_deleted_at":%d}`, time.Now().Add(-2*time.Hour).UnixMilli()),
	})
	require.NoError(t, err)
	out := run("--dry-run")
	t.Log(out)
	require.Contains(t, out, "bounded by topic "+topic+", margin 1m0s")
	require.Contains(t, out, index+": would purge 1 tombstone(s), kept 1 newer than the horizon")
	require.True(t, exists("old"))

	out = run()
	t.Log(out)
	require.Contains(t, out, index+": purged 1 tombstone(s), kept 1 newer than the horizon")
	require.False(t, exists("old"), "the tombstone before the horizon is gone")
	require.True(t, exists("new"), "the tombstone after the horizon stays")
	require.NotContains(t, out, foreign)
	ok, err := f.client.Exists().Index(foreign).Id("old").Do(ctx)
	require.NoError(t, err)
	require.True(t, ok, "a foreign index is not purged")
}

// indexer run with TOMBSTONE_PURGE_INTERVAL purges on its own.
func TestRunPurgesTombstonesOnSchedule(t *testing.T) {
	f := newPurgeFixture(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var stderr bytes.Buffer
	go func() {
		done <- cli.Dispatch(ctx, "indexer", "test", commands(), []string{"run",
			"--kafka-brokers", f.brokers[0], "--topic", f.topic, "--group", stack.UniqueName("group"),
			"--elasticsearch-url", f.esURL, "--alias", f.alias, "--metrics-addr", "",
			"--database-url", stack.Database(t), "--tombstone-purge-interval", "200ms", "--tombstone-purge-margin", "1m",
		}, io.Discard, &stderr)
	}()
	require.Eventually(t, func() bool { return !f.exists(t, "old") }, time.Minute, 100*time.Millisecond, "old tombstone purged")
	require.True(t, f.exists(t, "new"), "the tombstone after the horizon stays")
	cancel()
	require.Equal(t, 0, <-done, stderr.String())
}
