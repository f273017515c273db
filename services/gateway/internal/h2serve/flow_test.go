package h2serve

import (
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
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
	f = rc.next(isGoAway)
	require.Equal(t, http2.ErrCodeStreamClosed, f.(*http2.GoAwayFrame).ErrCode)
}

func TestDataBeyondStreamWindowResetsStream(t *testing.T) {
	release := make(chan struct{})
	h := http.HandlerFunc(func(http.ResponseWriter, *http.Request) { <-release }) // never reads
	addr := startServer(t, &Server{Handler: h})
	defer close(release)
	rc := dialRaw(t, addr)
	rc.headers(1, false, requestFields("/")...)
	for range 5 {
		require.NoError(t, rc.fr.WriteData(1, false, make([]byte, maxFrameSize)))
	}
	f := rc.next(func(f http2.Frame) bool { _, ok := f.(*http2.RSTStreamFrame); return ok }).(*http2.RSTStreamFrame)
	require.Equal(t, http2.ErrCodeFlowControl, f.ErrCode)
}
