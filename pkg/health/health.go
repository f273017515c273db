// Package health serves every leasehold process's operational endpoints:
//
//   - /livez: the process's loops are making progress. It never touches the
//     database, so a database outage does not get every process restarted.
//   - /readyz: the database answers and the role is ready (a gateway holds
//     its lease, a worker holds its first shards).
//   - /healthz/detail: JSON for operators (leases, epochs, loop ages, role),
//     behind a bearer token compared in constant time.
//   - /metrics: Prometheus exposition of the process's own registry.
//   - /debug/pprof/: Go's profiles, behind the same token as
//     /healthz/detail (pprof.go).
package health

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Check is a readiness or liveness check; nil means healthy.
type Check func(ctx context.Context) error

// Handler serves the health endpoints. Register checks before serving.
type Handler struct {
	token    string
	gatherer prometheus.Gatherer

	mu        sync.RWMutex
	live      map[string]Check
	ready     map[string]Check
	details   map[string]func(ctx context.Context) any
	startedAt time.Time
}

// New returns a Handler exposing gatherer on /metrics. token protects
// /healthz/detail; an empty token disables that endpoint (403).
func New(gatherer prometheus.Gatherer, token string) *Handler {
	return &Handler{
		token:     token,
		gatherer:  gatherer,
		live:      map[string]Check{},
		ready:     map[string]Check{},
		details:   map[string]func(ctx context.Context) any{},
		startedAt: time.Now(),
	}
}

// AddLiveness registers a liveness check under name.
func (h *Handler) AddLiveness(name string, c Check) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.live[name] = c
}

// AddReadiness registers a readiness check under name.
func (h *Handler) AddReadiness(name string, c Check) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ready[name] = c
}

// AddDetail registers a section of /healthz/detail.
func (h *Handler) AddDetail(name string, fn func(ctx context.Context) any) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.details[name] = fn
}

// ServeMux returns a mux with the endpoints above; callers may add more.
func (h *Handler) ServeMux() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /livez", h.serveChecks(func() map[string]Check { return h.live }))
	mux.HandleFunc("GET /readyz", h.serveChecks(func() map[string]Check { return h.ready }))
	mux.HandleFunc("GET /healthz/detail", h.serveDetail)
	mux.Handle("GET /metrics", promhttp.HandlerFor(h.gatherer, promhttp.HandlerOpts{}))
	h.mountPprof(mux)
	return mux
}

type checkResult struct {
	Name  string `json:"name"`
	OK    bool   `json:"ok"`
	Error string `json:"error,omitempty"`
}

func (h *Handler) run(ctx context.Context, checks map[string]Check) ([]checkResult, bool) {
	h.mu.RLock()
	names := make([]string, 0, len(checks))
	for n := range checks {
		names = append(names, n)
	}
	h.mu.RUnlock()
	sort.Strings(names)
	ok := true
	out := make([]checkResult, 0, len(names))
	for _, n := range names {
		h.mu.RLock()
		c := checks[n]
		h.mu.RUnlock()
		r := checkResult{Name: n, OK: true}
		if err := c(ctx); err != nil {
			r.OK, r.Error, ok = false, err.Error(), false
		}
		out = append(out, r)
	}
	return out, ok
}

func (h *Handler) serveChecks(which func() map[string]Check) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		results, ok := h.run(ctx, which())
		status := http.StatusOK
		if !ok {
			status = http.StatusServiceUnavailable
		}
		// Which checks ran and why one failed is detail for operators:
		// shown with the health token only, since /livez and /readyz
		// themselves answer anyone (probes carry no token).
		if !Authorized(r, h.token) {
			w.WriteHeader(status)
			if ok {
				fmt.Fprintln(w, "ok")
			} else {
				fmt.Fprintln(w, "not ok (checks and errors: ?verbose with the health token, or /healthz/detail)")
			}
			return
		}
		if r.URL.Query().Has("verbose") || !ok {
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			w.WriteHeader(status)
			for _, c := range results {
				if c.OK {
					fmt.Fprintf(w, "[+] %s ok\n", c.Name)
				} else {
					fmt.Fprintf(w, "[-] %s failed: %s\n", c.Name, c.Error)
				}
			}
			return
		}
		w.WriteHeader(status)
		fmt.Fprintln(w, "ok")
	}
}

// Authorized reports whether r carries "Authorization: Bearer <token>",
// compared in constant time. An empty token authorizes nobody.
func Authorized(r *http.Request, token string) bool {
	if token == "" {
		return false
	}
	got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	return ok && subtle.ConstantTimeCompare([]byte(got), []byte(token)) == 1
}

func (h *Handler) serveDetail(w http.ResponseWriter, r *http.Request) {
	if h.token == "" {
		http.Error(w, "healthz/detail is disabled: set a health token", http.StatusForbidden)
		return
	}
	if !Authorized(r, h.token) {
		w.Header().Set("WWW-Authenticate", `Bearer realm="leasehold"`)
		http.Error(w, "unauthenticated: bearer token required", http.StatusUnauthorized)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	live, liveOK := h.run(ctx, h.live)
	ready, readyOK := h.run(ctx, h.ready)
	out := map[string]any{
		"live":       liveOK,
		"ready":      readyOK,
		"checks":     map[string]any{"livez": live, "readyz": ready},
		"started_at": h.startedAt.UTC(),
		"uptime":     time.Since(h.startedAt).Round(time.Millisecond).String(),
	}
	h.mu.RLock()
	details := make(map[string]func(context.Context) any, len(h.details))
	for k, v := range h.details {
		details[k] = v
	}
	h.mu.RUnlock()
	for k, fn := range details {
		out[k] = fn(ctx)
	}
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(out)
}
