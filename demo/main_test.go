package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

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
