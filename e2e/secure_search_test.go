package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/demo"
	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/internal/testproc"
)

// The indexer through the engine's HTTPS proxy, with basic auth from a
// file and with an API key: the index equals the source. A wrong password
// ends it in one line and creates nothing.
func TestPipelineThroughSecuredSearch(t *testing.T) {
	t.Parallel()
	ss := stack.SecuredSearch(t)
	s := ss.Settings
	for _, tc := range []struct {
		name string
		env  []string
	}{
		{"basic auth", []string{"ELASTICSEARCH_URL=" + s["SEARCH_BASIC_URL"], "ELASTICSEARCH_CA_FILE=" + s["ELASTICSEARCH_CA_FILE"],
			"ELASTICSEARCH_USERNAME=" + s["ELASTICSEARCH_USERNAME"], "ELASTICSEARCH_PASSWORD=" + s["ELASTICSEARCH_PASSWORD"]}},
		{"API key", []string{"ELASTICSEARCH_URL=" + s["SEARCH_APIKEY_URL"], "ELASTICSEARCH_CA_FILE=" + s["ELASTICSEARCH_CA_FILE"],
			"ELASTICSEARCH_API_KEY=" + s["ELASTICSEARCH_API_KEY"]}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			const rows = 1000
			p := newPipeline(t, pipelineOptions{TopicPartitions: 3})
			require.NoError(t, demo.Seed(ctx, p.pool, demo.SeedOptions{Rows: rows}))
			pub := p.startPublisher("LOG_LEVEL=warn")
			ix := p.startIndexer(append([]string{"LOG_LEVEL=warn"}, tc.env...)...)
			procs := func() string { return "publisher:\n" + tail(pub.Stderr(), 20) + "\nindexer:\n" + tail(ix.Stderr(), 20) }
			p.runBatcher(3 * time.Minute)
			st := p.waitSettled(ctx, 4*time.Minute, procs)
			require.EqualValues(t, rows, st.Report.IndexDocs)
		})
	}

	t.Run("wrong password", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		p := newPipeline(t, pipelineOptions{TopicPartitions: 1})
		const wrong = "wrong-search-password"
		start := time.Now()
		proc := testproc.Run(t, time.Minute, p.indexerBin, p.env("ELASTICSEARCH_URL=https://"+s["ELASTICSEARCH_USERNAME"]+":"+wrong+"@"+s["SEARCH_BASIC_URL"][len("https://"):],
			"ELASTICSEARCH_CA_FILE="+s["ELASTICSEARCH_CA_FILE"]), "run")
		took := time.Since(start)
		require.NotEqual(t, 0, proc.ExitCode())
		require.Less(t, took, 20*time.Second)
		last := lastLine(proc.Stderr())
		t.Logf("indexer exited %d after %s: %s", proc.ExitCode(), took.Round(time.Millisecond), last)
		require.Contains(t, last, "401")
		require.Contains(t, last, "ELASTICSEARCH_PASSWORD")
		require.NotContains(t, proc.Stderr(), wrong)
		exists, err := p.es.IndexExists(p.alias + "-write").Do(ctx)
		require.NoError(t, err)
		require.False(t, exists)
	})
}
