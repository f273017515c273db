package h2serve

import (
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

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

// TestBadPrefaceClosed: a client that does not speak HTTP/2 (here
// HTTP/1.1, longer than the 24-byte preface) is served nothing and sees the
// connection end cleanly (EOF), not reset: closing with its unread bytes
// would send a TCP reset, which RFC 9113 section 3.4's "terminate the
// connection" (h2spec http2/3.5/2) does not allow.
func TestBadPrefaceClosed(t *testing.T) {
	addr := startServer(t, &Server{Handler: newTestService().mux()})
	nc, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer nc.Close()
	_, err = io.WriteString(nc, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	require.NoError(t, err)
	_ = nc.SetReadDeadline(time.Now().Add(5 * time.Second))
	b, err := io.ReadAll(nc)
	require.NoError(t, err, "the connection must end with EOF, not a reset")
	require.Empty(t, b)
}

func TestPrefaceTimeout(t *testing.T) {
	addr := startServer(t, &Server{Handler: newTestService().mux(), ReadHeaderTimeout: 100 * time.Millisecond})
	nc, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer nc.Close()
	_ = nc.SetReadDeadline(time.Now().Add(5 * time.Second))
	start := time.Now()
	_, err = io.ReadAll(nc)
	require.NoError(t, err)
	require.Less(t, time.Since(start), 3*time.Second)
}

func TestProtocolErrorsAreConnectionErrors(t *testing.T) {
	addr := startServer(t, &Server{Handler: newTestService().mux()})
	cases := map[string]struct {
		send func(rc *rawClient)
		code http2.ErrCode
	}{
		"DATA on stream 0": {func(rc *rawClient) { require.NoError(t, rc.fr.WriteData(0, false, []byte("x"))) }, http2.ErrCodeProtocol},
		"DATA on an idle stream": {func(rc *rawClient) {
			require.NoError(t, rc.fr.WriteData(5, false, []byte("x")))
		}, http2.ErrCodeProtocol},
		"even stream id": {func(rc *rawClient) { rc.headers(2, true, requestFields(unaryPath)...) }, http2.ErrCodeProtocol},
		"frame too large": {func(rc *rawClient) {
			require.NoError(t, rc.fr.WriteData(1, false, make([]byte, maxFrameSize+1)))
		}, http2.ErrCodeFrameSize},
		"window overflow": {func(rc *rawClient) {
			require.NoError(t, rc.fr.WriteWindowUpdate(0, 1<<31-1))
		}, http2.ErrCodeFlowControl},
		"HEADERS without CONTINUATION": {func(rc *rawClient) {
			rc.hbuf.Reset()
			require.NoError(t, rc.henc.WriteField(hpack.HeaderField{Name: ":method", Value: "POST"}))
			require.NoError(t, rc.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: rc.hbuf.Bytes()}))
			_ = rc.fr.WritePing(false, [8]byte{}) // the server may have closed already
		}, http2.ErrCodeProtocol},
		"bad setting": {func(rc *rawClient) {
			require.NoError(t, rc.fr.WriteSettings(http2.Setting{ID: http2.SettingEnablePush, Val: 7}))
		}, http2.ErrCodeProtocol},
		"PUSH_PROMISE": {func(rc *rawClient) {
			rc.fr.AllowIllegalWrites = true
			require.NoError(t, rc.fr.WritePushPromise(http2.PushPromiseParam{StreamID: 1, PromiseID: 2, EndHeaders: true}))
		}, http2.ErrCodeProtocol},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			rc := dialRaw(t, addr)
			rc.t = t
			tc.send(rc)
			f := rc.next(isGoAway).(*http2.GoAwayFrame)
			require.Equal(t, tc.code, f.ErrCode, "debug: %s", f.DebugData())
			_ = rc.nc.SetReadDeadline(time.Now().Add(5 * time.Second))
			for {
				if _, err := rc.fr.ReadFrame(); err != nil {
					break // closed
				}
			}
		})
	}
}

func TestHeaderListTooLarge(t *testing.T) {
	addr := startServer(t, &Server{Handler: newTestService().mux(), MaxHeaderListSize: 1024})
	rc := dialRaw(t, addr)
	rc.headers(1, true, requestFields(unaryPath, "x-big", strings.Repeat("v", 900), "x-big2", strings.Repeat("w", 300))...)
	f := rc.next(func(f http2.Frame) bool { _, ok := f.(*http2.MetaHeadersFrame); return ok }).(*http2.MetaHeadersFrame)
	require.Equal(t, "431", f.PseudoValue("status"))
	require.True(t, f.StreamEnded())
	// The connection still serves.
	rc.headers(3, true, requestFields("/nope")...)
	f = rc.next(func(f http2.Frame) bool { _, ok := f.(*http2.MetaHeadersFrame); return ok }).(*http2.MetaHeadersFrame)
	require.Equal(t, uint32(3), f.StreamID)
	require.Equal(t, "404", f.PseudoValue("status"))
}

func TestRefusedStreamPastMaxConcurrent(t *testing.T) {
	ts := newTestService()
	addr := startServer(t, &Server{Handler: ts.mux(), MaxConcurrentStreams: 2})
	rc := dialRaw(t, addr)
	for id := uint32(1); id <= 5; id += 2 {
		rc.headers(id, false, requestFields(blockPath)...)
	}
	f := rc.next(func(f http2.Frame) bool { _, ok := f.(*http2.RSTStreamFrame); return ok }).(*http2.RSTStreamFrame)
	require.Equal(t, uint32(5), f.StreamID)
	require.Equal(t, http2.ErrCodeRefusedStream, f.ErrCode)
	close(ts.released)
}
