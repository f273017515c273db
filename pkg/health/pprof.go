package health

import (
	"context"
	"net/http"
	"net/http/pprof"
	"strconv"
	"time"
)

// maxProfileSeconds caps ?seconds= of /debug/pprof/profile and trace.
const maxProfileSeconds = 120

// mountPprof serves net/http/pprof under /debug/pprof/ behind the health
// token, like /healthz/detail: 403 when no token is configured, 401 without
// the right bearer token. A profile may run longer than the health server's
// write timeout (up to maxProfileSeconds): the handler extends the deadline
// of its own response only.
func (h *Handler) mountPprof(mux *http.ServeMux) {
	auth := func(w http.ResponseWriter, r *http.Request) bool {
		if h.token == "" {
			http.Error(w, "/debug/pprof is disabled: set a health token", http.StatusForbidden)
			return false
		}
		if !Authorized(r, h.token) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="leasehold"`)
			http.Error(w, "unauthenticated: bearer token required", http.StatusUnauthorized)
			return false
		}
		return true
	}
	guard := func(next http.HandlerFunc) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if auth(w, r) {
				next(w, r)
			}
		}
	}
	// timed runs a profile of ?seconds= (default def).
	timed := func(def int, next http.HandlerFunc) http.HandlerFunc {
		return guard(func(w http.ResponseWriter, r *http.Request) {
			n := def
			if secs := r.URL.Query().Get("seconds"); secs != "" {
				var err error
				if n, err = strconv.Atoi(secs); err != nil || n < 1 || n > maxProfileSeconds {
					http.Error(w, "seconds must be an integer in 1.."+strconv.Itoa(maxProfileSeconds), http.StatusBadRequest)
					return
				}
			}
			q := r.URL.Query()
			q.Set("seconds", strconv.Itoa(n))
			r.URL.RawQuery = q.Encode()
			_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(time.Duration(n+10) * time.Second))
			// pprof refuses a duration beyond the server's WriteTimeout,
			// which it reads from the context: the deadline set above is
			// this response's own.
			next(w, r.WithContext(context.WithValue(r.Context(), http.ServerContextKey, nil)))
		})
	}
	// pprof.Index also serves the named profiles (heap, goroutine, ...).
	mux.HandleFunc("GET /debug/pprof/", guard(pprof.Index))
	mux.HandleFunc("GET /debug/pprof/cmdline", guard(pprof.Cmdline))
	mux.HandleFunc("GET /debug/pprof/profile", timed(30, pprof.Profile))
	mux.HandleFunc("GET /debug/pprof/symbol", guard(pprof.Symbol))
	mux.HandleFunc("POST /debug/pprof/symbol", guard(pprof.Symbol))
	mux.HandleFunc("GET /debug/pprof/trace", timed(1, pprof.Trace))
}
