// Package metrics serves a Prometheus registry at /metrics next to /healthz
// (the process is alive) and /readyz (its dependencies answer).
package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
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
}

// NewHealth returns an empty Health.
func NewHealth() *Health {
	return &Health{checks: map[string]func(context.Context) error{}, degraded: map[string]string{}}
}

// AddCheck registers a readiness check run on every /readyz request.
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
	var errs []error
	for name, check := range checks {
		if err := check(ctx); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
		}
	}
	for part, reason := range degraded {
		errs = append(errs, fmt.Errorf("%s degraded: %s", part, reason))
	}
	return errors.Join(errs...)
}

// Serve listens on addr ("" disables the server) and serves until ctx ends.
// It returns once the listener is bound, so a bad address fails at start.
func Serve(ctx context.Context, addr string, reg *prometheus.Registry, health *Health, logger *slog.Logger) error {
	if addr == "" {
		return nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("METRICS_ADDR=%q: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		cctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		if err := health.ready(cctx); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
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
	logger.Info("serving metrics", slog.String("addr", ln.Addr().String()))
	return nil
}
