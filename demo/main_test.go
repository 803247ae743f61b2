package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The demo's own connections are plaintext: any security setting (or a
// URL given as a file) in the environment is named and refused; the local
// stack's variables are not.
func TestSecuritySettingsAreRefused(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		environ []string
		want    []string
	}{
		{name: "local stack", environ: []string{"DATABASE_URL=postgres://x", "KAFKA_BROKERS=127.0.0.1:9092", "ELASTICSEARCH_URL=http://127.0.0.1:9200", "ELASTICSEARCH7_URL=http://127.0.0.1:9201", "PATH=/bin"}},
		{name: "empty values", environ: []string{"KAFKA_TLS=", "ELASTICSEARCH_PASSWORD="}},
		{name: "secured", environ: []string{"KAFKA_TLS=true", "KAFKA_SASL_PASSWORD_FILE=/run/secrets/p", "ELASTICSEARCH_API_KEY=s3cret", "ELASTICSEARCH_URL_FILE=/run/secrets/u", "DATABASE_URL_FILE=/run/secrets/d", "KAFKA_TLS_INSECURE_SKIP_VERIFY=true"},
			want: []string{"DATABASE_URL_FILE", "ELASTICSEARCH_API_KEY", "ELASTICSEARCH_URL_FILE", "KAFKA_SASL_PASSWORD_FILE", "KAFKA_TLS", "KAFKA_TLS_INSECURE_SKIP_VERIFY"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, securitySettings(tc.environ))
		})
	}
}

// The demo ends by naming the pages to read next, the walk-through with
// one's own table first, and each page it names exists.
func TestNextStepsNameExistingPages(t *testing.T) {
	t.Parallel()
	var out strings.Builder
	printNextSteps(&out)
	pages := regexp.MustCompile(`docs/[a-z-]+\.md`).FindAllString(out.String(), -1)
	require.NotEmpty(t, pages, out.String())
	require.Equal(t, "docs/getting-started.md", pages[0], out.String())
	for _, p := range pages {
		_, err := os.Stat(filepath.Join("..", p))
		require.NoError(t, err, "the demo points at %s", p)
	}
}

// Reconcile waits while the indexer's lag moves, goes ahead once it is 0
// or unexported, and once it has stayed the same for lagStuck (a failed
// commit leaves the gauge where it was); a lag back at 0 starts the clock
// again.
func TestLagGate(t *testing.T) {
	t.Parallel()
	var g lagGate
	t0 := time.Unix(1000, 0)
	require.True(t, g.hold(500, true, t0), "behind")
	require.True(t, g.hold(200, true, t0.Add(4*time.Second)), "still moving")
	require.True(t, g.hold(200, true, t0.Add(8*time.Second)), "the same for 4 s")
	require.False(t, g.hold(200, true, t0.Add(9*time.Second)), "the same for 5 s: stuck")
	require.False(t, g.hold(0, true, t0.Add(10*time.Second)), "caught up")
	require.True(t, g.hold(200, true, t0.Add(20*time.Second)), "behind again: a new clock")
	require.False(t, g.hold(0, false, t0.Add(21*time.Second)), "no metric: no gate")
}
