package cli_test

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/metrics"
)

func TestMetricsSettings(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	pwFile := filepath.Join(dir, "pw")
	require.NoError(t, os.WriteFile(pwFile, []byte("from-file\n"), 0o600))
	empty := filepath.Join(dir, "empty")
	require.NoError(t, os.WriteFile(empty, nil, 0o600))
	for _, tc := range []struct {
		name    string
		env     map[string]string
		want    metrics.Endpoint
		wantErr string
	}{
		{name: "default is loopback without auth", want: metrics.Endpoint{Addr: "127.0.0.1:9999"}},
		{name: "all interfaces on purpose", env: map[string]string{"METRICS_ADDR": "0.0.0.0:9999"}, want: metrics.Endpoint{Addr: "0.0.0.0:9999"}},
		{name: "password", env: map[string]string{"METRICS_USERNAME": "prom", "METRICS_PASSWORD": "pw"}, want: metrics.Endpoint{Addr: "127.0.0.1:9999", Username: "prom", Password: "pw"}},
		{name: "password file, newline trimmed", env: map[string]string{"METRICS_USERNAME": "prom", "METRICS_PASSWORD_FILE": pwFile}, want: metrics.Endpoint{Addr: "127.0.0.1:9999", Username: "prom", Password: "from-file"}},
		{name: "user without password", env: map[string]string{"METRICS_USERNAME": "prom"}, wantErr: "set both or neither"},
		{name: "password without user", env: map[string]string{"METRICS_PASSWORD": "pw"}, wantErr: "set both or neither"},
		{name: "both password settings", env: map[string]string{"METRICS_USERNAME": "prom", "METRICS_PASSWORD": "pw", "METRICS_PASSWORD_FILE": pwFile}, wantErr: "set one, not both"},
		{name: "missing file", env: map[string]string{"METRICS_USERNAME": "prom", "METRICS_PASSWORD_FILE": filepath.Join(dir, "nope")}, wantErr: "METRICS_PASSWORD_FILE="},
		{name: "empty file", env: map[string]string{"METRICS_USERNAME": "prom", "METRICS_PASSWORD_FILE": empty}, wantErr: "the file is empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var m cli.Metrics
			fs := cli.NewFlagSet("x", "")
			m.RegisterMetrics(fs, "127.0.0.1:9999")
			fs.SetLookupEnv(func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok })
			_, err := fs.Parse(nil)
			require.NoError(t, err)
			ep, err := m.Endpoint()
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, ep)
		})
	}
}

func TestMetricsPasswordNeverPrinted(t *testing.T) {
	t.Parallel()
	var m cli.Metrics
	fs := cli.NewFlagSet("x", "")
	m.RegisterMetrics(fs, "127.0.0.1:9999")
	fs.SetLookupEnv(func(k string) (string, bool) { return "hunter2", k == "METRICS_PASSWORD" })
	_, err := fs.Parse(nil)
	require.NoError(t, err)
	var out bytes.Buffer
	fs.PrintUsage(&out)
	require.Contains(t, out.String(), "METRICS_PASSWORD_FILE")
	require.NotContains(t, out.String(), "hunter2")
}
