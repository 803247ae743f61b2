package metrics_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

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

func TestBasicAuthGuardsMetricsAndReadyz(t *testing.T) {
	t.Parallel()
	h := metrics.NewHealth()
	h.AddCheck("consumer group", func(context.Context) error {
		return errors.New("group outboxrelay-indexer on 10.0.0.7:9092: member indexer-1a2b not found")
	})
	base := serve(t, metrics.Endpoint{Addr: freeAddr(t), Username: "prom", Password: "s3cret"}, h)
	for _, tc := range []struct {
		name, user, pass string
		want             int // /metrics
		wantReady        int // /readyz
	}{
		{"no credentials", "", "", http.StatusUnauthorized, http.StatusUnauthorized},
		{"wrong password", "prom", "nope", http.StatusUnauthorized, http.StatusUnauthorized},
		{"wrong user", "root", "s3cret", http.StatusUnauthorized, http.StatusUnauthorized},
		{"right", "prom", "s3cret", http.StatusOK, http.StatusServiceUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, body := get(t, base+"/metrics", tc.user, tc.pass)
			require.Equal(t, tc.want, code, body)
			if code == http.StatusOK {
				require.Contains(t, body, "process_start_time_seconds")
			}
			// /readyz is behind the same credentials; its detail (hosts,
			// group and client ids) goes to an authenticated caller only.
			code, body = get(t, base+"/readyz", tc.user, tc.pass)
			require.Equal(t, tc.wantReady, code, body)
			if tc.wantReady == http.StatusUnauthorized {
				require.Equal(t, "unauthorized\n", body)
			} else {
				require.Contains(t, body, "consumer group: group outboxrelay-indexer on 10.0.0.7:9092: member indexer-1a2b not found")
			}
		})
	}
	// Liveness needs no credentials.
	code, body := get(t, base+"/healthz", "", "")
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "ok\n", body)
}

// Readiness is checked at most once a second, whatever the number of
// probes: each check is a remote call (the engine, the group, the
// database). Concurrent requests share one run of the checks.
func TestReadyzCachedForASecond(t *testing.T) {
	t.Parallel()
	h := metrics.NewHealth()
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	var mu sync.Mutex
	metrics.SetClock(h, func() time.Time { mu.Lock(); defer mu.Unlock(); return now })
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	var calls atomic.Int32
	var fail atomic.Bool
	release := make(chan struct{})
	h.AddCheck("engine", func(context.Context) error {
		calls.Add(1)
		<-release
		if fail.Load() {
			return errors.New("engine down")
		}
		return nil
	})
	srv := httptest.NewServer(metrics.Handler(metrics.Endpoint{}, metrics.NewRegistry(), h))
	defer srv.Close()

	// Ten probes at once: one run of the checks.
	var wg sync.WaitGroup
	codes := make(chan int, 10)
	for range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := http.Get(srv.URL + "/readyz")
			if err != nil {
				codes <- 0
				return
			}
			resp.Body.Close()
			codes <- resp.StatusCode
		}()
	}
	require.Eventually(t, func() bool { return calls.Load() == 1 }, 10*time.Second, time.Millisecond)
	close(release)
	wg.Wait()
	close(codes)
	for c := range codes {
		require.Equal(t, http.StatusOK, c)
	}
	require.EqualValues(t, 1, calls.Load())

	// Within the second: the cached answer, even though the engine failed.
	fail.Store(true)
	advance(999 * time.Millisecond)
	code, _ := get(t, srv.URL+"/readyz", "", "")
	require.Equal(t, http.StatusOK, code)
	require.EqualValues(t, 1, calls.Load())

	// After it: checked again.
	advance(time.Millisecond)
	code, body := get(t, srv.URL+"/readyz", "", "")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "engine: engine down\n", body)
	require.EqualValues(t, 2, calls.Load())
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
	now := time.Now()
	var mu sync.Mutex
	metrics.SetClock(h, func() time.Time { mu.Lock(); defer mu.Unlock(); return now })
	nextSecond := func() { mu.Lock(); now = now.Add(time.Second); mu.Unlock() } // past the cache
	var dbErr error
	h.AddCheck("postgres", func(context.Context) error { return dbErr })
	h.AddCheck("a check", func(context.Context) error { return nil })
	base := serve(t, metrics.Endpoint{Addr: freeAddr(t)}, h)

	code, body := get(t, base+"/readyz", "", "")
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "ready\n", body)

	dbErr = errors.New("dial tcp 127.0.0.1:5432: connection refused")
	h.SetDegraded("kafka", "broker 127.0.0.1:9092 unreachable")
	nextSecond()
	code, body = get(t, base+"/readyz", "", "")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "postgres: dial tcp 127.0.0.1:5432: connection refused\nkafka degraded: broker 127.0.0.1:9092 unreachable", strings.TrimSpace(body))

	dbErr = nil
	h.SetDegraded("kafka", "")
	nextSecond()
	code, _ = get(t, base+"/readyz", "", "")
	require.Equal(t, http.StatusOK, code)
}
