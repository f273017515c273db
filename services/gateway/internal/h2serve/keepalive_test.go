package h2serve

import (
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
)

func TestPingTimeoutClosesDeadPeer(t *testing.T) {
	srv := &Server{Handler: newTestService().mux(), PingInterval: 100 * time.Millisecond, PingTimeout: 100 * time.Millisecond}
	rc := dialRaw(t, startServer(t, srv))
	f := rc.next(func(f http2.Frame) bool { p, ok := f.(*http2.PingFrame); return ok && !p.IsAck() })
	require.Equal(t, pingPayload, f.(*http2.PingFrame).Data)
	// Never answer: the server closes the connection.
	start := time.Now()
	_ = rc.nc.SetReadDeadline(time.Now().Add(5 * time.Second))
	for {
		if _, err := rc.fr.ReadFrame(); err != nil {
			require.ErrorIs(t, err, io.EOF)
			break
		}
	}
	require.Less(t, time.Since(start), 3*time.Second)
}

func TestPingAnsweredKeepsConnection(t *testing.T) {
	srv := &Server{Handler: newTestService().mux(), PingInterval: 50 * time.Millisecond, PingTimeout: 200 * time.Millisecond}
	rc := dialRaw(t, startServer(t, srv))
	for range 4 {
		f := rc.next(func(f http2.Frame) bool { p, ok := f.(*http2.PingFrame); return ok && !p.IsAck() })
		require.NoError(t, rc.fr.WritePing(true, f.(*http2.PingFrame).Data))
	}
	// A client PING is answered.
	require.NoError(t, rc.fr.WritePing(false, [8]byte{1, 2, 3}))
	f := rc.next(func(f http2.Frame) bool { p, ok := f.(*http2.PingFrame); return ok && p.IsAck() })
	require.Equal(t, [8]byte{1, 2, 3}, f.(*http2.PingFrame).Data)
}
