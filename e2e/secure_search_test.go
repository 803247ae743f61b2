package e2e

import (
	"context"
	"encoding/base64"
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

// The indexer through the engine's HTTPS proxy, with basic auth (the
// password from a file) and with an API key (key and URL from files; the
// publisher reads DATABASE_URL_FILE): the index equals the source. A wrong
// password (user info in ELASTICSEARCH_URL_FILE), a wrong API key, an
// untrusted CA or a missing or foreign client certificate ends it within
// seconds in one line naming the setting, shows no secret, and writes
// nothing: no index, no committed offset.
func TestPipelineThroughSecuredSearch(t *testing.T) {
	t.Parallel()
	ss := stack.SecuredSearch(t)
	s := ss.Settings
	secret := func(t *testing.T, name, value string) string {
		f := filepath.Join(t.TempDir(), name)
		require.NoError(t, os.WriteFile(f, []byte(value+"\n"), 0o600))
		return f
	}
	for _, tc := range []struct {
		name string
		env  func(t *testing.T) []string
	}{
		{"basic auth", func(t *testing.T) []string {
			return []string{"ELASTICSEARCH_URL=" + s["SEARCH_BASIC_URL"], "ELASTICSEARCH_CA_FILE=" + s["ELASTICSEARCH_CA_FILE"],
				"ELASTICSEARCH_USERNAME=" + s["ELASTICSEARCH_USERNAME"], "ELASTICSEARCH_PASSWORD_FILE=" + secret(t, "search-password", s["ELASTICSEARCH_PASSWORD"])}
		}},
		{"API key", func(t *testing.T) []string {
			return []string{"ELASTICSEARCH_URL=", "ELASTICSEARCH_URL_FILE=" + secret(t, "search-url", s["SEARCH_APIKEY_URL"]), "ELASTICSEARCH_CA_FILE=" + s["ELASTICSEARCH_CA_FILE"],
				"ELASTICSEARCH_API_KEY_FILE=" + secret(t, "search-api-key", s["ELASTICSEARCH_API_KEY"])}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			const rows = 1000
			p := newPipeline(t, pipelineOptions{TopicPartitions: 3})
			require.NoError(t, demo.Seed(ctx, p.pool, demo.SeedOptions{Rows: rows}))
			pub := p.startPublisher("LOG_LEVEL=warn", "DATABASE_URL=", "DATABASE_URL_FILE="+secret(t, "database-url", p.dbURL))
			ix := p.startIndexer(append([]string{"LOG_LEVEL=warn"}, tc.env(t)...)...)
			procs := func() string { return "publisher:\n" + tail(pub.Stderr(), 20) + "\nindexer:\n" + tail(ix.Stderr(), 20) }
			p.runBatcher(3 * time.Minute)
			st := p.waitSettled(ctx, 4*time.Minute, procs)
			require.EqualValues(t, rows, st.Report.IndexDocs)
			require.EqualValues(t, rows, st.Index.Live, "documents through the read alias equal to the source")
		})
	}

	t.Run("misconfigured", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		p := newPipeline(t, pipelineOptions{TopicPartitions: 2})
		// Records on the topic, so a committed offset would show.
		// RequireAll: the writer's default (no acknowledgement) may lose a record.
		w := &kafka.Writer{Addr: kafka.TCP(p.brokers...), Topic: p.topic, Balancer: &kafka.Hash{}, BatchTimeout: 10 * time.Millisecond, RequiredAcks: kafka.RequireAll}
		require.NoError(t, w.WriteMessages(ctx, kafka.Message{Key: []byte("1"), Value: []byte("{}")}, kafka.Message{Key: []byte("2"), Value: []byte("{}")}))
		require.NoError(t, w.Close())

		const wrongPassword, wrongKey = "wrong-search-password", "wrong-search-key"
		withUser := func(url, user, pass string) string {
			return "https://" + user + ":" + pass + "@" + strings.TrimPrefix(url, "https://")
		}
		basic := []string{"ELASTICSEARCH_URL=" + s["SEARCH_BASIC_URL"], "ELASTICSEARCH_USERNAME=" + s["ELASTICSEARCH_USERNAME"],
			"ELASTICSEARCH_PASSWORD_FILE=" + secret(t, "search-password", s["ELASTICSEARCH_PASSWORD"])}
		mtls := []string{"ELASTICSEARCH_URL=" + s["SEARCH_MTLS_URL"], "ELASTICSEARCH_CA_FILE=" + s["ELASTICSEARCH_CA_FILE"]}
		apiKeyID, _, _ := strings.Cut(s["ELASTICSEARCH_API_KEY"], ":")
		for _, tc := range []struct {
			name string
			env  []string
			want []string
		}{
			{"wrong password", []string{"ELASTICSEARCH_URL=", "ELASTICSEARCH_URL_FILE=" + secret(t, "search-url", withUser(s["SEARCH_BASIC_URL"], s["ELASTICSEARCH_USERNAME"], wrongPassword)),
				"ELASTICSEARCH_CA_FILE=" + s["ELASTICSEARCH_CA_FILE"]}, []string{"401", "ELASTICSEARCH_PASSWORD"}},
			{"wrong API key", []string{"ELASTICSEARCH_URL=" + s["SEARCH_APIKEY_URL"], "ELASTICSEARCH_CA_FILE=" + s["ELASTICSEARCH_CA_FILE"],
				"ELASTICSEARCH_API_KEY=" + apiKeyID + ":" + wrongKey}, []string{"401", "ELASTICSEARCH_API_KEY"}},
			{"untrusted CA", append(basic, "ELASTICSEARCH_CA_FILE="+s["SEARCH_OTHER_CA_FILE"]), []string{"unknown authority", "ELASTICSEARCH_CA_FILE"}},
			{"no client certificate", mtls, []string{"ELASTICSEARCH_CERT_FILE"}},
			{"client certificate of another CA", append(mtls, "ELASTICSEARCH_CERT_FILE="+s["SEARCH_OTHER_CERT_FILE"],
				"ELASTICSEARCH_KEY_FILE="+s["SEARCH_OTHER_KEY_FILE"]), []string{"ELASTICSEARCH_CERT_FILE"}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				start := time.Now()
				proc := testproc.Run(t, time.Minute, p.indexerBin, p.env(tc.env...), "run")
				took := time.Since(start)
				require.NotEqual(t, 0, proc.ExitCode(), "the indexer must refuse to start:\n%s", tail(proc.Stderr(), 10))
				require.Less(t, took, 20*time.Second, "took %s to fail", took)
				last := lastLine(proc.Stderr())
				t.Logf("indexer exited %d after %s: %s", proc.ExitCode(), took.Round(time.Millisecond), last)
				require.True(t, strings.HasPrefix(last, "indexer run: "), "the error is the last line: %q", last)
				for _, w := range tc.want {
					require.Contains(t, last, w)
				}
				for _, secret := range []string{wrongPassword, s["ELASTICSEARCH_PASSWORD"], wrongKey, s["ELASTICSEARCH_API_KEY"],
					base64.StdEncoding.EncodeToString([]byte(apiKeyID + ":" + wrongKey))} {
					require.NotContains(t, proc.Stderr(), secret, "a secret was printed")
				}
			})
		}

		// One name at a time: IndexExists of several is false when any is missing.
		for _, name := range []string{p.alias, p.alias + "-write"} {
			exists, err := p.es.IndexExists(name).Do(ctx)
			require.NoError(t, err)
			require.False(t, exists, "an indexer that could not reach the engine created %s", name)
		}
		gens, err := p.es.CatIndices().Index(p.alias + "_*").Do(ctx)
		require.NoError(t, err)
		require.Empty(t, gens, "an indexer that could not reach the engine created a generation")
		st, err := p.status(ctx)
		require.NoError(t, err)
		require.Len(t, st.Partitions, 2)
		for _, po := range st.Partitions {
			require.EqualValues(t, -1, po.Committed, "partition %d has a committed offset", po.Partition)
		}
		require.EqualValues(t, 2, st.TotalLag(), "both records are still to be indexed")
	})
}
