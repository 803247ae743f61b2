package metrics_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/metrics"
)

func get(t *testing.T, url, user, pass string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	if user != "" || pass != "" {
		req.SetBasicAuth(user, pass)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().String()
}

func serve(t *testing.T, ep metrics.Endpoint, h *metrics.Health) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	require.NoError(t, metrics.Serve(ctx, ep, metrics.NewRegistry(), h, slog.New(slog.DiscardHandler)))
	return "http://" + ep.Addr
}

func TestBasicAuthGuardsMetricsOnly(t *testing.T) {
	t.Parallel()
	base := serve(t, metrics.Endpoint{Addr: freeAddr(t), Username: "prom", Password: "s3cret"}, metrics.NewHealth())
	for _, tc := range []struct {
		name, user, pass string
		want             int
	}{
		{"no credentials", "", "", http.StatusUnauthorized},
		{"wrong password", "prom", "nope", http.StatusUnauthorized},
		{"wrong user", "root", "s3cret", http.StatusUnauthorized},
		{"right", "prom", "s3cret", http.StatusOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, body := get(t, base+"/metrics", tc.user, tc.pass)
			require.Equal(t, tc.want, code, body)
			if code == http.StatusOK {
				require.Contains(t, body, "process_start_time_seconds")
			}
		})
	}
	// Probes need no credentials.
	code, _ := get(t, base+"/healthz", "", "")
	require.Equal(t, http.StatusOK, code)
	code, _ = get(t, base+"/readyz", "", "")
	require.Equal(t, http.StatusOK, code)
}

func TestNoAuthByDefault(t *testing.T) {
	t.Parallel()
	base := serve(t, metrics.Endpoint{Addr: freeAddr(t)}, metrics.NewHealth())
	code, body := get(t, base+"/metrics", "", "")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "go_goroutines")
}

func TestServeRefusesHalfTheCredentials(t *testing.T) {
	t.Parallel()
	err := metrics.Serve(context.Background(), metrics.Endpoint{Addr: freeAddr(t), Username: "prom"}, metrics.NewRegistry(), metrics.NewHealth(), slog.New(slog.DiscardHandler))
	require.ErrorContains(t, err, "METRICS_USERNAME and METRICS_PASSWORD")
}

func TestReadyzSaysWhy(t *testing.T) {
	t.Parallel()
	h := metrics.NewHealth()
	var dbErr error
	h.AddCheck("postgres", func(context.Context) error { return dbErr })
	h.AddCheck("a check", func(context.Context) error { return nil })
	base := serve(t, metrics.Endpoint{Addr: freeAddr(t)}, h)

	code, body := get(t, base+"/readyz", "", "")
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "ready\n", body)

	dbErr = errors.New("dial tcp 127.0.0.1:5432: connection refused")
	h.SetDegraded("kafka", "broker 127.0.0.1:9092 unreachable")
	code, body = get(t, base+"/readyz", "", "")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "postgres: dial tcp 127.0.0.1:5432: connection refused\nkafka degraded: broker 127.0.0.1:9092 unreachable", strings.TrimSpace(body))

	dbErr = nil
	h.SetDegraded("kafka", "")
	code, _ = get(t, base+"/readyz", "", "")
	require.Equal(t, http.StatusOK, code)
}
