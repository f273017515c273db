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
	"golang.org/x/net/http2"

	"github.com/leasehold/leasehold/pkg/tlstest"
)

// TestResetStreamReturnsUnreadDataToConnWindow: DATA buffered for a
// handler that never read it is dropped when the stream is reset; its
// bytes must still go back to the connection window, or a connection
// whose streams get reset with unread data stalls for good.
func TestResetStreamReturnsUnreadDataToConnWindow(t *testing.T) {
	h := http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }) // never reads
	rc := dialRaw(t, startServer(t, &Server{Handler: h}))
	connSend := int64(65535) // the client's connection send window
	// waitWindow reads frames until the connection window holds need bytes.
	waitWindow := func(need int64) {
		deadline := time.Now().Add(3 * time.Second)
		for connSend < need {
			_ = rc.nc.SetReadDeadline(deadline)
			f, err := rc.fr.ReadFrame()
			require.NoError(t, err, "connection window stuck at %d", connSend)
			switch f := f.(type) {
			case *http2.WindowUpdateFrame:
				if f.StreamID == 0 {
					connSend += int64(f.Increment)
				}
			case *http2.SettingsFrame:
				if !f.IsAck() {
					if v, ok := f.Value(http2.SettingHeaderTableSize); ok {
						rc.henc.SetMaxDynamicTableSize(v)
					}
					require.NoError(t, rc.fr.WriteSettingsAck())
				}
			case *http2.GoAwayFrame:
				t.Fatalf("GOAWAY %s: %s", f.ErrCode, f.DebugData())
			}
		}
	}
	chunk := make([]byte, 16000)
	for i := range 40 { // 40 * 64000 bytes: 2.4 times the connection window
		id := uint32(2*i + 1)
		rc.headers(id, false, requestFields("/")...)
		for range 4 {
			waitWindow(int64(len(chunk)))
			require.NoError(t, rc.fr.WriteData(id, false, chunk))
			connSend -= int64(len(chunk))
		}
		require.NoError(t, rc.fr.WriteRSTStream(id, http2.ErrCodeCancel))
	}
}

// TestMalformedRequestIsStreamError: a request the framer rejects (an
// upper-case header name, RFC 9113 section 8.2.1) is a stream error: the
// stream is reset and the connection's other streams carry on.
func TestMalformedRequestIsStreamError(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	})
	rc := dialRaw(t, startServer(t, &Server{Handler: h}))
	rc.headers(1, false, requestFields("/")...)
	rc.next(func(f http2.Frame) bool { _, ok := f.(*http2.MetaHeadersFrame); return ok })
	rc.headers(3, true, requestFields("/", "X-Upper", "v")...)
	f := rc.next(func(f http2.Frame) bool {
		_, rst := f.(*http2.RSTStreamFrame)
		return rst || isGoAway(f)
	})
	rst, ok := f.(*http2.RSTStreamFrame)
	require.True(t, ok, "got %v", f)
	require.Equal(t, uint32(3), rst.StreamID)
	require.Equal(t, http2.ErrCodeProtocol, rst.ErrCode)
	// A zero WINDOW_UPDATE increment on a stream is a stream error too.
	require.NoError(t, rc.fr.WriteWindowUpdate(1, 0))
	f = rc.next(func(f http2.Frame) bool {
		_, rst := f.(*http2.RSTStreamFrame)
		return rst || isGoAway(f)
	})
	rst, ok = f.(*http2.RSTStreamFrame)
	require.True(t, ok, "got %v", f)
	require.Equal(t, uint32(1), rst.StreamID)
	require.Equal(t, http2.ErrCodeProtocol, rst.ErrCode)
	// The connection still serves.
	rc.headers(5, true, requestFields("/nope")...)
	hf := rc.next(func(f http2.Frame) bool { _, ok := f.(*http2.MetaHeadersFrame); return ok || isGoAway(f) })
	require.IsType(t, &http2.MetaHeadersFrame{}, hf)
	require.Equal(t, uint32(5), hf.Header().StreamID)
}

// TestNoFramesAfterReset: once a stream is reset a handler's flush sends
// nothing on it (RFC 9113 section 5.1: no frames on a closed stream) and
// reports the reset.
func TestNoFramesAfterReset(t *testing.T) {
	flushErr := make(chan error, 1)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
		w.WriteHeader(http.StatusOK)
		flushErr <- w.(interface{ FlushError() error }).FlushError()
	})
	rc := dialRaw(t, startServer(t, &Server{Handler: h}))
	rc.headers(1, false, requestFields("/")...)
	require.NoError(t, rc.fr.WriteRSTStream(1, http2.ErrCodeCancel))
	select {
	case err := <-flushErr:
		require.ErrorIs(t, err, errStreamReset)
	case <-time.After(5 * time.Second):
		t.Fatal("handler did not flush")
	}
	require.NoError(t, rc.fr.WritePing(false, [8]byte{7}))
	rc.next(func(f http2.Frame) bool {
		if f.Header().StreamID == 1 {
			t.Fatalf("frame on the reset stream: %v", f)
		}
		p, ok := f.(*http2.PingFrame)
		return ok && p.IsAck()
	})
}

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

// TestHeadersNotHeldByFlowControl: HEADERS are not flow-controlled
// (RFC 9113 section 6.9): a response whose DATA waits for window still
// sends its header at once.
func TestHeadersNotHeldByFlowControl(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write(make([]byte, 1000))
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	})
	rc := dialRaw(t, startServer(t, &Server{Handler: h}), http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0})
	rc.headers(1, false, requestFields("/")...)
	f := rc.next(func(f http2.Frame) bool { return f.Header().StreamID == 1 })
	require.IsType(t, &http2.MetaHeadersFrame{}, f)
	require.NoError(t, rc.fr.WriteWindowUpdate(1, 1000))
	d := rc.next(func(f http2.Frame) bool { _, ok := f.(*http2.DataFrame); return ok }).(*http2.DataFrame)
	require.Len(t, d.Data(), 1000)
}

// TestHeadersOnClosedStream: HEADERS on a stream the peer had ended are a
// connection error (STREAM_CLOSED, RFC 9113 section 5.1), but trailers
// still in flight for a stream the server cut short (its handler returned
// before the request ended) only reset that stream.
func TestHeadersOnClosedStream(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) })
	rc := dialRaw(t, startServer(t, &Server{Handler: h}))
	// Stream 1: the handler answers before the request's END_STREAM.
	rc.headers(1, false, requestFields("/")...)
	f := rc.next(func(f http2.Frame) bool {
		r, ok := f.(*http2.RSTStreamFrame)
		return ok && r.StreamID == 1 || isGoAway(f)
	})
	require.Equal(t, http2.ErrCodeNo, f.(*http2.RSTStreamFrame).ErrCode)
	rc.headers(1, true, "x-trailer", "v") // trailers in flight
	f = rc.next(func(f http2.Frame) bool { _, ok := f.(*http2.RSTStreamFrame); return ok || isGoAway(f) })
	require.Equal(t, http2.ErrCodeStreamClosed, f.(*http2.RSTStreamFrame).ErrCode)
	// Stream 3: ended by the peer and answered; HEADERS again end the connection.
	rc.headers(3, true, requestFields("/")...)
	rc.next(func(f http2.Frame) bool {
		return f.Header().StreamID == 3 && f.Header().Flags.Has(http2.FlagHeadersEndStream)
	})
	rc.headers(3, true, requestFields("/")...)
	f = rc.next(func(f http2.Frame) bool { return isGoAway(f) })
	require.Equal(t, http2.ErrCodeStreamClosed, f.(*http2.GoAwayFrame).ErrCode)
}
