package health_test

import (
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/health"
)

// serve runs the health mux of token in an http.Server with the short
// timeouts of a process's health server.
func serve(t *testing.T, token string) string {
	t.Helper()
	h := health.New(prometheus.NewRegistry(), token)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := &http.Server{Handler: h.ServeMux(), ReadHeaderTimeout: time.Second, WriteTimeout: 500 * time.Millisecond}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close(); <-done })
	return "http://" + ln.Addr().String()
}

func get(t *testing.T, url, token string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 30 * time.Second}).Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

func TestPprofBehindHealthToken(t *testing.T) {
	const token = "health-token-for-pprof"
	base := serve(t, token)
	for _, path := range []string{"/debug/pprof/", "/debug/pprof/heap", "/debug/pprof/goroutine?debug=1", "/debug/pprof/cmdline", "/debug/pprof/profile?seconds=1"} {
		code, _ := get(t, base+path, "")
		require.Equal(t, http.StatusUnauthorized, code, "%s without a token", path)
		code, _ = get(t, base+path, "wrong-token-of-same-size")
		require.Equal(t, http.StatusUnauthorized, code, "%s with a wrong token", path)
	}
	code, body := get(t, base+"/debug/pprof/", token)
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "goroutine")
	code, body = get(t, base+"/debug/pprof/goroutine?debug=1", token)
	require.Equal(t, http.StatusOK, code)
	require.True(t, strings.HasPrefix(body, "goroutine profile:"), body)
	code, _ = get(t, base+"/debug/pprof/profile?seconds=0", token)
	require.Equal(t, http.StatusBadRequest, code)
	// A CPU profile longer than the server's 500ms write timeout completes.
	code, body = get(t, base+"/debug/pprof/profile?seconds=1", token)
	require.Equal(t, http.StatusOK, code, body)
	require.NotEmpty(t, body)
}

func TestPprofDisabledWithoutHealthToken(t *testing.T) {
	base := serve(t, "")
	code, _ := get(t, base+"/debug/pprof/", "")
	require.Equal(t, http.StatusForbidden, code)
	code, _ = get(t, base+"/debug/pprof/heap", "anything")
	require.Equal(t, http.StatusForbidden, code)
}
