package main

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

func TestMain(m *testing.M) { stack.Main(m) }

func dispatch(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = cli.Dispatch(context.Background(), "publisher", "test", commands(&out), args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// `publisher topics ensure` with PUBLISHER_TOPICS creates exactly the topics
// listed, each with its own partition count, on the real broker.
func TestTopicsEnsureCreatesPublisherTopics(t *testing.T) {
	brokers := stack.KafkaBrokers(t)
	orders, users := stack.UniqueName("orders"), stack.UniqueName("users")
	t.Setenv("KAFKA_BROKERS", brokers[0])
	t.Setenv("PUBLISHER_TOPICS", orders+":3:1,"+users+":2:1")
	code, out, errOut := dispatch(t, "topics", "ensure")
	require.Zero(t, code, errOut)
	require.Regexp(t, orders+`\s+3\s+created`, out)
	require.Regexp(t, users+`\s+2\s+created`, out)

	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 30 * time.Second}
	meta, err := client.Metadata(context.Background(), &kafka.MetadataRequest{Topics: []string{orders, users}})
	require.NoError(t, err)
	got := map[string]int{}
	for _, mt := range meta.Topics {
		require.NoError(t, mt.Error, mt.Name)
		got[mt.Name] = len(mt.Partitions)
	}
	require.Equal(t, map[string]int{orders: 3, users: 2}, got)

	// Again: nothing to do, exit 0.
	code, out, errOut = dispatch(t, "topics", "ensure")
	require.Zero(t, code, errOut)
	require.Regexp(t, orders+`\s+3\s+exists`, out)
}

func TestPublisherTopicsBadValueExitsWithUsage(t *testing.T) {
	t.Setenv("KAFKA_BROKERS", "127.0.0.1:1")
	t.Setenv("DATABASE_URL", "postgres://127.0.0.1:1/none")
	tests := []struct {
		name string
		args []string
		env  string
		want string
	}{
		{name: "run, no partitions", args: []string{"run"}, env: "orders:3", want: `PUBLISHER_TOPICS="orders:3": "orders:3" is not name:partitions:replication`},
		{name: "run, zero partitions", args: []string{"run"}, env: "orders:0:3", want: "PUBLISHER_TOPICS=\"orders:0:3\": topic orders: partitions=0"},
		{name: "ensure, twice", args: []string{"topics", "ensure"}, env: "orders:3:1,orders:3:1", want: "topic orders is listed twice"},
		{name: "ensure, list and --topics", args: []string{"topics", "ensure", "--topics", "users", "--partitions", "3", "--replication-factor", "1"}, env: "orders:3:1", want: "PUBLISHER_TOPICS and TOPICS"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("PUBLISHER_TOPICS", tt.env)
			code, _, errOut := dispatch(t, tt.args...)
			require.Equal(t, cli.ExitUsage, code, errOut)
			require.Contains(t, errOut, tt.want)
		})
	}
}
