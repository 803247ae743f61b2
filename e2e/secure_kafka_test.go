package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// secureEnv returns the settings that reach the secured broker's SASL_SSL
// listener with mechanism (the password read from a file, as from a
// Docker/Kubernetes secret), or its mTLS listener when mechanism is "mTLS".
func secureEnv(t *testing.T, k *stack.SecureKafka, mechanism string) []string {
	s := k.Settings
	if mechanism == "mTLS" {
		return []string{"KAFKA_BROKERS=" + s["KAFKA_SSL_BROKERS"], "KAFKA_TLS=true", "KAFKA_TLS_CA_FILE=" + s["KAFKA_TLS_CA_FILE"],
			"KAFKA_TLS_CERT_FILE=" + s["KAFKA_TLS_CERT_FILE"], "KAFKA_TLS_KEY_FILE=" + s["KAFKA_TLS_KEY_FILE"]}
	}
	pw := filepath.Join(t.TempDir(), "kafka-password")
	require.NoError(t, os.WriteFile(pw, []byte(s["KAFKA_SASL_PASSWORD"]+"\n"), 0o600))
	return []string{"KAFKA_BROKERS=" + s["KAFKA_SASL_SSL_BROKERS"], "KAFKA_TLS=true", "KAFKA_TLS_CA_FILE=" + s["KAFKA_TLS_CA_FILE"],
		"KAFKA_SASL_MECHANISM=" + mechanism, "KAFKA_SASL_USERNAME=" + s["KAFKA_SASL_USERNAME"], "KAFKA_SASL_PASSWORD_FILE=" + pw}
}

// onSecuredKafka is a pipeline whose binaries are pointed at the secured
// broker by the caller; the test's own checks use its plaintext listener.
func onSecuredKafka(t *testing.T, k *stack.SecureKafka, partitions int) *pipeline {
	p := newPipeline(t, pipelineOptions{TopicPartitions: 1})
	p.brokers = []string{k.Env}
	createTopic(t, p.brokers, p.topic, partitions)
	return p
}

// The whole pipeline over the secured listeners, every mechanism used by
// one of the two services: `publisher topics ensure` creates the topic,
// all rows reach the index, a poison record is dead-lettered, and
// `indexer dead-letter replay` re-publishes it, all over the same secured
// listener as the service.
func TestPipelineOverSecuredKafka(t *testing.T) {
	t.Parallel()
	k := stack.SecuredKafka(t)
	for _, tc := range []struct{ name, publisher, indexer string }{
		{"publisher SCRAM-SHA-512, indexer PLAIN", "SCRAM-SHA-512", "PLAIN"},
		{"publisher mTLS, indexer SCRAM-SHA-256", "mTLS", "SCRAM-SHA-256"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			const rows = 2000
			p := newPipeline(t, pipelineOptions{TopicPartitions: 1})
			p.brokers = []string{k.Env} // the test's own checks use the plaintext listener
			pubEnv := append([]string{"LOG_LEVEL=warn"}, secureEnv(t, k, tc.publisher)...)
			ensure := testproc.Run(t, time.Minute, p.publisherBin, p.env(append(pubEnv, "TOPICS="+p.topic, "TOPIC_PARTITIONS=3", "TOPIC_REPLICATION_FACTOR=1")...), "topics", "ensure")
			require.Equal(t, 0, ensure.ExitCode(), ensure.Stderr())
			require.Regexp(t, p.topic+`\s+3\s+created`, ensure.Stdout())

			// A record of no known event type: the indexer dead-letters it.
			// The plaintext listener may learn of the new partitions a moment
			// after the one `topics ensure` asked: retry only that error.
			w := &kafka.Writer{Addr: kafka.TCP(k.Env), Topic: p.topic, BatchTimeout: 10 * time.Millisecond, RequiredAcks: kafka.RequireAll}
			for deadline := time.Now().Add(30 * time.Second); ; {
				err := w.WriteMessages(ctx, kafka.Message{Key: []byte("poison-1"), Value: []byte(`{"not":"an event"}`)})
				if err == nil {
					break
				}
				require.ErrorIs(t, err, kafka.UnknownTopicOrPartition)
				require.True(t, time.Now().Before(deadline), "the topic %s was not writable 30s after topics ensure: %v", p.topic, err)
			}
			require.NoError(t, w.Close())

			require.NoError(t, demo.Seed(ctx, p.pool, demo.SeedOptions{Rows: rows}))
			pub := p.startPublisher(pubEnv...)
			ixEnv := append([]string{"LOG_LEVEL=warn"}, secureEnv(t, k, tc.indexer)...)
			ix := p.startIndexer(ixEnv...)
			procs := func() string { return "publisher:\n" + tail(pub.Stderr(), 20) + "\nindexer:\n" + tail(ix.Stderr(), 20) }
			p.runBatcher(3 * time.Minute)
			s := p.waitSettled(ctx, 4*time.Minute, procs)
			require.EqualValues(t, rows, s.Report.SourceRows)
			require.EqualValues(t, rows, s.Report.IndexDocs)
			require.EqualValues(t, rows, s.Index.Live, "documents through the read alias equal to the source")
			// The dead-letter topic is created at its first record, and the
			// status reads its end offsets over the plaintext listener, which
			// may learn of the new topic a moment later.
			for deadline := time.Now().Add(time.Minute); ; {
				pubDL, ixDL := p.deadLetters(ctx)
				require.Zero(t, pubDL)
				if ixDL == 1 {
					break
				}
				require.Zero(t, ixDL, "the poison record, dead-lettered once")
				require.True(t, time.Now().Before(deadline), "the poison record was not dead-lettered within a minute\n%s", procs())
				pause(ctx, 250*time.Millisecond)
			}

			// The replay reads the dead-letter topic and writes to the topic
			// over the secured listener; the running indexer meets the
			// record again and dead-letters it again.
			replay := testproc.Run(t, time.Minute, p.indexerBin, p.env(ixEnv...), "dead-letter", "replay")
			require.Equal(t, 0, replay.ExitCode(), replay.Stderr())
			require.Contains(t, replay.Stdout(), "re-published 1 message(s)")
			deadline := time.Now().Add(time.Minute)
			for {
				st, err := p.status(ctx)
				require.NoError(t, err)
				if st.DeadLettered == 2 && st.TotalLag() == 0 {
					require.EqualValues(t, 1, st.DeadLetterPending, "the first dead letter is replayed, the second not yet")
					break
				}
				require.True(t, time.Now().Before(deadline), "the replayed record was not dead-lettered again: %+v\n%s", st, procs())
				pause(ctx, 250*time.Millisecond)
			}

			// The status command reads lag over the same secured listener.
			st := testproc.Run(t, time.Minute, p.indexerBin, p.env(ixEnv...), "status")
			require.Equal(t, 0, st.ExitCode(), st.Stderr())
			require.Contains(t, st.Stdout(), p.topic)
		})
	}
}

// A wrong password, an untrusted CA, a missing setting or a listener of
// another protocol ends the service within seconds with one line naming
// the setting, and nothing is written: the outbox keeps every event, the
// topic stays empty, no index is created.
func TestSecuredKafkaMisconfigurationFailsFast(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	k := stack.SecuredKafka(t)
	s := k.Settings
	const rows = 50
	p := onSecuredKafka(t, k, 3)
	require.NoError(t, demo.Seed(ctx, p.pool, demo.SeedOptions{Rows: rows}))
	p.runBatcher(2 * time.Minute)
	backlog := p.outboxBacklog(ctx)
	require.EqualValues(t, rows, backlog)

	const wrong = "wrong-password-123"
	with := func(base []string, kv ...string) []string { return append(append([]string(nil), base...), kv...) }
	scram := secureEnv(t, k, "SCRAM-SHA-512")
	for _, tc := range []struct {
		name   string
		binary string
		env    []string
		want   string
	}{
		{"publisher, wrong password", "publisher", with(scram, "KAFKA_SASL_PASSWORD_FILE=", "KAFKA_SASL_PASSWORD="+wrong), "KAFKA_SASL_PASSWORD"},
		{"publisher, untrusted CA", "publisher", with(scram, "KAFKA_TLS_CA_FILE="+s["KAFKA_OTHER_CA_FILE"]), "KAFKA_TLS_CA_FILE"},
		{"publisher, no password", "publisher", with(scram, "KAFKA_SASL_PASSWORD_FILE="), "KAFKA_SASL_PASSWORD"},
		{"publisher, SASL_SSL listener without SASL", "publisher", with(scram, "KAFKA_SASL_MECHANISM=", "KAFKA_SASL_USERNAME=", "KAFKA_SASL_PASSWORD_FILE="), "KAFKA_SASL_MECHANISM"},
		{"publisher, mTLS without a client certificate", "publisher", with(secureEnv(t, k, "mTLS"), "KAFKA_TLS_CERT_FILE=", "KAFKA_TLS_KEY_FILE="), "KAFKA_TLS_CERT_FILE"},
		{"indexer, wrong password", "indexer", with(secureEnv(t, k, "PLAIN"), "KAFKA_SASL_PASSWORD_FILE=", "KAFKA_SASL_PASSWORD="+wrong), "KAFKA_SASL_PASSWORD"},
		{"indexer, untrusted CA", "indexer", with(secureEnv(t, k, "SCRAM-SHA-256"), "KAFKA_TLS_CA_FILE="+s["KAFKA_OTHER_CA_FILE"]), "KAFKA_TLS_CA_FILE"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bin := p.publisherBin
			if tc.binary == "indexer" {
				bin = p.indexerBin
			}
			start := time.Now()
			proc := testproc.Run(t, time.Minute, bin, p.env(tc.env...), "run")
			took := time.Since(start)
			require.NotEqual(t, 0, proc.ExitCode(), "%s must refuse to start:\n%s\n...\n%s", tc.binary, head(proc.Stderr(), 5), tail(proc.Stderr(), 5))
			require.Less(t, took, 20*time.Second, "%s took %s to fail", tc.binary, took)
			last := lastLine(proc.Stderr())
			t.Logf("%s exited %d after %s: %s", tc.binary, proc.ExitCode(), took.Round(time.Millisecond), last)
			require.True(t, strings.HasPrefix(last, tc.binary+" run: "), "the error is the last line: %q", last)
			require.Contains(t, last, tc.want)
			require.NotContains(t, proc.Stderr(), wrong, "a password was printed")
			require.NotContains(t, proc.Stderr(), s["KAFKA_SASL_PASSWORD"], "a password was printed")
		})
	}

	require.Equal(t, backlog, p.outboxBacklog(ctx), "the outbox lost events to a publisher that could not connect")
	c := &kafka.Client{Addr: kafka.TCP(p.brokers...), Timeout: 30 * time.Second}
	lo, err := c.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{
		p.topic: {kafka.LastOffsetOf(0), kafka.LastOffsetOf(1), kafka.LastOffsetOf(2)},
	}})
	require.NoError(t, err)
	for _, po := range lo.Topics[p.topic] {
		require.NoError(t, po.Error)
		require.Zero(t, po.LastOffset, "partition %d got records", po.Partition)
	}
	exists, err := p.es.IndexExists(p.alias + "-write").Do(ctx)
	require.NoError(t, err)
	require.False(t, exists, "an indexer that could not reach Kafka created the index")
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return lines[len(lines)-1]
}

func head(s string, n int) string {
	lines := strings.SplitN(s, "\n", n+1)
	return strings.Join(lines[:min(n, len(lines))], "\n")
}
