// Package metrics serves a Prometheus registry at /metrics next to /healthz
// (the process is alive) and /readyz (its dependencies answer).
package metrics

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// NewRegistry returns a registry with the Go and process collectors.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// Health collects named readiness checks and a degraded flag that services
// set while a dependency fails (e.g. the broker is unreachable).
type Health struct {
	mu       sync.Mutex
	checks   map[string]func(context.Context) error
	degraded map[string]string
	now      func() time.Time // time.Now; tests replace it

	// readyMu serializes the runs of the checks: a request waits for the
	// run in flight and takes its result.
	readyMu   sync.Mutex
	readyAt   time.Time // when the cached result was computed (zero: none)
	readyErr  error
	readyOnce bool
}

// ReadyCache is how long a readiness result is reused: each check is a
// remote call, and probes (or anyone who can reach the endpoint) must not
// multiply them.
const ReadyCache = time.Second

// NewHealth returns an empty Health.
func NewHealth() *Health {
	return &Health{checks: map[string]func(context.Context) error{}, degraded: map[string]string{}, now: time.Now}
}

// AddCheck registers a readiness check, run by /readyz at most once a
// second (ReadyCache).
func (h *Health) AddCheck(name string, check func(context.Context) error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.checks[name] = check
}

// SetDegraded marks (reason != "") or clears (reason == "") a degraded part.
func (h *Health) SetDegraded(part, reason string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if reason == "" {
		delete(h.degraded, part)
	} else {
		h.degraded[part] = reason
	}
}

// Degraded returns a copy of the degraded parts and their reasons.
func (h *Health) Degraded() map[string]string {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make(map[string]string, len(h.degraded))
	for k, v := range h.degraded {
		out[k] = v
	}
	return out
}

// cachedReady returns the result of the checks, run again only when the
// last result is ReadyCache old. The checks get their own deadline, not the
// request's context: a client that hangs up must not leave a cancelled
// result for the others.
func (h *Health) cachedReady() error {
	h.readyMu.Lock()
	defer h.readyMu.Unlock()
	now := h.now
	if now == nil {
		now = time.Now
	}
	if h.readyOnce && now().Sub(h.readyAt) < ReadyCache {
		return h.readyErr
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	h.readyErr = h.ready(ctx)
	h.readyAt, h.readyOnce = now(), true
	return h.readyErr
}

func (h *Health) ready(ctx context.Context) error {
	h.mu.Lock()
	checks := make(map[string]func(context.Context) error, len(h.checks))
	for k, v := range h.checks {
		checks[k] = v
	}
	degraded := make(map[string]string, len(h.degraded))
	for k, v := range h.degraded {
		degraded[k] = v
	}
	h.mu.Unlock()
	// Sorted, so the body of /readyz reads the same on every request.
	var errs []error
	for _, name := range slices.Sorted(maps.Keys(checks)) {
		if err := checks[name](ctx); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
		}
	}
	for _, part := range slices.Sorted(maps.Keys(degraded)) {
		errs = append(errs, fmt.Errorf("%s degraded: %s", part, degraded[part]))
	}
	return errors.Join(errs...)
}

// Endpoint says where and how Serve answers.
type Endpoint struct {
	// Addr is the listen address, e.g. 127.0.0.1:9102; "" disables the
	// server. The services default to loopback: a remote Prometheus needs
	// 0.0.0.0:PORT (or the host's address) set on purpose.
	Addr string
	// Username and Password, when both set, require HTTP basic auth on
	// /metrics and /readyz (whose answer names hosts, the cluster, group
	// and client ids). /healthz stays open for liveness probes. Default:
	// none.
	Username, Password string
}

// Handler serves /metrics and /readyz (both behind basic auth when ep has
// credentials) and /healthz (always open: it says only that the process
// answers).
func Handler(ep Endpoint, reg *prometheus.Registry, health *Health) http.Handler {
	mux := http.NewServeMux()
	var m http.Handler = promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg})
	var ready http.Handler = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if err := health.cachedReady(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	if ep.Username != "" || ep.Password != "" {
		m = basicAuth(ep.Username, ep.Password, m)
		ready = basicAuth(ep.Username, ep.Password, ready)
	}
	mux.Handle("/metrics", m)
	mux.Handle("/readyz", ready)
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	return mux
}

func basicAuth(user, pass string, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u, p, ok := r.BasicAuth()
		// Both compared, always, so the time taken says nothing about
		// which one was wrong.
		userOK := subtle.ConstantTimeCompare([]byte(u), []byte(user)) == 1
		passOK := subtle.ConstantTimeCompare([]byte(p), []byte(pass)) == 1
		if !ok || !userOK || !passOK {
			w.Header().Set("WWW-Authenticate", `Basic realm="metrics", charset="UTF-8"`)
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// Serve listens on ep.Addr ("" disables the server) and serves [Handler]
// until ctx ends. It returns once the listener is bound, so a bad address
// fails at start.
func Serve(ctx context.Context, ep Endpoint, reg *prometheus.Registry, health *Health, logger *slog.Logger) error {
	if ep.Addr == "" {
		return nil
	}
	if (ep.Username == "") != (ep.Password == "") {
		return errors.New("METRICS_USERNAME and METRICS_PASSWORD (or METRICS_PASSWORD_FILE): set both or neither")
	}
	ln, err := net.Listen("tcp", ep.Addr)
	if err != nil {
		return fmt.Errorf("METRICS_ADDR=%q: %w", ep.Addr, err)
	}
	srv := &http.Server{Handler: Handler(ep, reg, health), ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("metrics server stopped", slog.String("error", err.Error()))
		}
	}()
	logger.Info("serving metrics", slog.String("addr", ln.Addr().String()), slog.Bool("basic_auth", ep.Username != ""))
	return nil
}
