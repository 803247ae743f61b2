package main

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/olivere/elastic/v7"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/sink"
)

// indexer tombstones purge prints the horizon and the source bounding it,
// counts with --dry-run, and then deletes exactly the tombstones before
// the horizon.
func TestTombstonesPurgeCommand(t *testing.T) {
	ctx := context.Background()
	brokers := stack.KafkaBrokers(t)
	esURL := stack.ElasticsearchURL(t)
	client, err := sink.NewClient(esURL)
	require.NoError(t, err)
	alias, topic := stack.UniqueName("purge"), stack.UniqueName("purge")
	t.Cleanup(func() { _, _ = client.DeleteIndex(alias + "_*").Do(context.Background()) })
	index, err := sink.EnsureIndex(ctx, client, alias, alias+"-write", sink.DefaultMapping)
	require.NoError(t, err)

	kc := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 30 * time.Second}
	_, err = kc.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: 1, ReplicationFactor: -1}}})
	require.NoError(t, err)
	w := &kafka.Writer{Addr: kafka.TCP(brokers...), Topic: topic, RequiredAcks: kafka.RequireAll, AllowAutoTopicCreation: false}
	t.Cleanup(func() { _ = w.Close() })
	require.Eventually(t, func() bool { // the partition's leader is elected a moment after creation
		return w.WriteMessages(ctx, kafka.Message{Key: []byte("z"), Value: []byte(`{}`)}) == nil
	}, 30*time.Second, 100*time.Millisecond)

	// A tombstone written two hours ago and one written now; the topic's
	// oldest record is from now, the margin one minute.
	for id, at := range map[string]time.Time{"old": time.Now().Add(-2 * time.Hour), "new": time.Now()} {
		_, err := client.PerformRequest(ctx, elastic.PerformRequestOptions{
			Method: http.MethodPut, Path: "/" + alias + "-write/_doc/" + id,
			Params: map[string][]string{"version": {"2"}, "version_type": {"external"}, "refresh": {"true"}},
			Body:   fmt.Sprintf(`{"_deleted":true,"_deleted_at":%d}`, at.UnixMilli()),
		})
		require.NoError(t, err)
	}
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
	exists := func(id string) bool {
		ok, err := client.Exists().Index(alias + "-write").Id(id).Do(ctx)
		require.NoError(t, err)
		return ok
	}
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
}
