package h2serve

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

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

func TestWriteTimeoutOnStalledReader(t *testing.T) {
	handlerErr := make(chan error, 1)
	h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		chunk := make([]byte, 8<<10)
		for range 64 { // 512 KiB: far past the 64 KiB stream window
			if _, err := w.Write(chunk); err != nil {
				handlerErr <- err
				return
			}
		}
		handlerErr <- nil
	})
	addr := startServer(t, &Server{Handler: h, WriteTimeout: 200 * time.Millisecond})
	rc := dialRaw(t, addr)
	rc.headers(1, true, requestFields("/")...)
	// Read but never grant window.
	f := rc.next(func(f http2.Frame) bool { _, ok := f.(*http2.RSTStreamFrame); return ok }).(*http2.RSTStreamFrame)
	require.Equal(t, http2.ErrCodeCancel, f.ErrCode)
	select {
	case err := <-handlerErr:
		require.ErrorIs(t, err, errFlowTimeout)
	case <-time.After(5 * time.Second):
		t.Fatal("handler still blocked")
	}
	// The connection is still usable.
	require.NoError(t, rc.fr.WritePing(false, [8]byte{9}))
	rc.next(func(f http2.Frame) bool { p, ok := f.(*http2.PingFrame); return ok && p.IsAck() })
}

func TestHeaderTableSizes(t *testing.T) {
	for _, size := range []uint32{0, 512, 4096} {
		ts := newTestService()
		addr := startServer(t, &Server{Handler: ts.mux(), HeaderTableSize: size})
		for _, hc := range []*http.Client{h2cClient(t), xClient(t)} {
			client := connect.NewClient[wrapperspb.BytesValue, wrapperspb.BytesValue](hc, "http://"+addr+unaryPath, connect.WithGRPC())
			for i := range 20 { // one connection: later requests use what earlier ones indexed
				req := connect.NewRequest(wrapperspb.Bytes([]byte("h")))
				req.Header().Set("X-Custom", strings.Repeat("c", i*10))
				_, err := client.CallUnary(context.Background(), req)
				require.NoError(t, err, "table %d, call %d", size, i)
			}
		}
	}
}
