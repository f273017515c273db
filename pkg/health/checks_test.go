package health_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/health"
)

// TestReadinessDetailNeedsTheToken: /readyz answers anyone with its status
// only; which checks ran and a failing check's error (a database address,
// a peer's name) need the health token, with ?verbose or on failure.
func TestReadinessDetailNeedsTheToken(t *testing.T) {
	t.Parallel()
	h := health.New(prometheus.NewRegistry(), "health-tok")
	h.AddReadiness("database", func(context.Context) error { return errors.New("dial 10.1.2.3:5432: refused") })
	h.AddReadiness("session", func(context.Context) error { return nil })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := &http.Server{Handler: h.ServeMux(), ReadHeaderTimeout: time.Second}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close(); <-done })
	url := "http://" + ln.Addr().String() + "/readyz"

	for _, u := range []string{url, url + "?verbose"} {
		code, body := get(t, u, "")
		require.Equal(t, http.StatusServiceUnavailable, code)
		require.NotContains(t, body, "database", u)
		require.NotContains(t, body, "10.1.2.3", u)
		code, body = get(t, u, "wrong-token")
		require.Equal(t, http.StatusServiceUnavailable, code)
		require.NotContains(t, body, "10.1.2.3", u)
	}
	code, body := get(t, url+"?verbose", "health-tok")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Contains(t, body, "[-] database failed: dial 10.1.2.3:5432: refused")
	require.Contains(t, body, "[+] session ok")
}
