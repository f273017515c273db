package h2serve

import (
	"context"
	"crypto/tls"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/tlstest"
)

// hookCtx runs hook when a request context is derived from it.
type hookCtx struct {
	context.Context
	hook func()
}

func (h hookCtx) Done() <-chan struct{} { h.hook(); return nil }

// TestStreamOpenedAsConnectionClosesIsCancelled: a connection closed (by
// Close, a PING timeout, a failed write) while its reader is setting up a
// new stream must still cancel that stream's handler.
func TestStreamOpenedAsConnectionClosesIsCancelled(t *testing.T) {
	srv := &Server{}
	var once sync.Once
	srv.BaseContext = hookCtx{Context: context.Background(), hook: func() {
		once.Do(func() { // between the checks of handleHeaders and the stream's registration
			srv.mu.Lock()
			conns := srv.snapshotLocked()
			srv.mu.Unlock()
			for _, c := range conns {
				c.closeWith(errServerClosed)
			}
		})
	}}
	release := make(chan struct{})
	srv.Handler = http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	})
	rc := dialRaw(t, startServer(t, srv))
	t.Cleanup(func() { close(release) })
	rc.headers(1, false, requestFields("/")...)
	require.Eventually(t, func() bool {
		srv.mu.Lock()
		defer srv.mu.Unlock()
		return len(srv.conns) == 0
	}, 3*time.Second, 5*time.Millisecond, "the connection is gone")
	require.Eventually(t, func() bool { return srv.streamsWG.Load() == 0 }, 3*time.Second, 5*time.Millisecond,
		"the handler of a stream opened as its connection closed was never cancelled")
}

// TestCloseDuringTLSHandshake: Close may run while connections are in
// their TLS handshake (run with -race).
func TestCloseDuringTLSHandshake(t *testing.T) {
	ca := tlstest.NewCA(t)
	cfg := &tls.Config{Certificates: []tls.Certificate{ca.Server(t)}, MinVersion: tls.VersionTLS12}
	for range 20 {
		srv := &Server{Handler: http.NotFoundHandler(), TLSConfig: cfg}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() { done <- srv.Serve(ln) }()
		var wg sync.WaitGroup
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				nc, err := tls.Dial("tcp", ln.Addr().String(), &tls.Config{RootCAs: ca.Pool(), NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS12})
				if err == nil {
					_ = nc.Close()
				}
			}()
		}
		time.Sleep(time.Millisecond) // the race being tested: Close lands during the handshakes
		require.NoError(t, srv.Close())
		require.ErrorIs(t, <-done, ErrServerClosed)
		wg.Wait()
		srv.Wait()
	}
}
