package h2serve

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"connectrpc.com/grpchealth"
	"connectrpc.com/grpcreflect"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/leasehold/leasehold/pkg/tlstest"
)

const (
	unaryPath  = "/test.Echo/Unary"
	serverPath = "/test.Echo/ServerStream"
	bidiPath   = "/test.Echo/Bidi"
	blockPath  = "/test.Echo/Block"
)

type testService struct {
	released   chan struct{} // Block returns once closed
	blockStart chan struct{} // signalled as Block starts
	cancelled  chan error    // Bidi reports its context's end here
}

func newTestService() *testService {
	return &testService{released: make(chan struct{}), blockStart: make(chan struct{}, 16), cancelled: make(chan error, 16)}
}

func (ts *testService) mux() *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle(unaryPath, connect.NewUnaryHandler(unaryPath, func(_ context.Context, r *connect.Request[wrapperspb.BytesValue]) (*connect.Response[wrapperspb.BytesValue], error) {
		if string(r.Msg.GetValue()) == "fail" {
			return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("asked to fail"))
		}
		res := connect.NewResponse(wrapperspb.Bytes(r.Msg.GetValue()))
		res.Trailer().Set("x-echo-len", strings.Repeat("x", len(r.Msg.GetValue())%7))
		return res, nil
	}))
	mux.Handle(serverPath, connect.NewServerStreamHandler(serverPath, func(_ context.Context, r *connect.Request[wrapperspb.BytesValue], st *connect.ServerStream[wrapperspb.BytesValue]) error {
		for range 5 {
			if err := st.Send(wrapperspb.Bytes(r.Msg.GetValue())); err != nil {
				return err
			}
		}
		return nil
	}))
	mux.Handle(bidiPath, connect.NewBidiStreamHandler(bidiPath, func(ctx context.Context, st *connect.BidiStream[wrapperspb.BytesValue, wrapperspb.BytesValue]) error {
		for {
			m, err := st.Receive()
			if errors.Is(err, io.EOF) {
				return nil
			}
			if err != nil {
				<-ctx.Done()
				ts.cancelled <- context.Cause(ctx)
				return err
			}
			if err := st.Send(m); err != nil {
				return err
			}
		}
	}, connect.WithReadMaxBytes(8<<20), connect.WithSendMaxBytes(8<<20)))
	mux.Handle(blockPath, connect.NewUnaryHandler(blockPath, func(ctx context.Context, r *connect.Request[wrapperspb.BytesValue]) (*connect.Response[wrapperspb.BytesValue], error) {
		ts.blockStart <- struct{}{}
		select {
		case <-ts.released:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return connect.NewResponse(r.Msg), nil
	}))
	mux.Handle(grpchealth.NewHandler(grpchealth.NewStaticChecker("test.Echo")))
	mux.Handle(grpcreflect.NewHandlerV1(grpcreflect.NewStaticReflector("grpc.health.v1.Health")))
	return mux
}

func startServer(t *testing.T, srv *Server) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		_ = srv.Close()
		require.ErrorIs(t, <-done, ErrServerClosed)
		srv.Wait()
	})
	return ln.Addr().String()
}

func h2cTransport() *http2.Transport {
	return &http2.Transport{AllowHTTP: true, DialTLSContext: func(ctx context.Context, network, addr string, _ *tls.Config) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}}
}

// h2cClient is net/http's HTTP/2 client over h2c; xClient is
// golang.org/x/net/http2's.
func h2cClient(t *testing.T) *http.Client {
	p := new(http.Protocols)
	p.SetUnencryptedHTTP2(true)
	tr := &http.Transport{Protocols: p}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

func xClient(t *testing.T) *http.Client {
	tr := h2cTransport()
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// protocols are the client options of the three protocols connect-go speaks.
var protocols = map[string][]connect.ClientOption{
	"connect": nil, "grpc": {connect.WithGRPC()}, "grpcweb": {connect.WithGRPCWeb()},
}

func TestUnaryAllProtocols(t *testing.T) {
	ts := newTestService()
	addr := startServer(t, &Server{Handler: ts.mux()})
	hc := h2cClient(t)
	for name, opts := range protocols {
		t.Run(name, func(t *testing.T) {
			client := connect.NewClient[wrapperspb.BytesValue, wrapperspb.BytesValue](hc, "http://"+addr+unaryPath, opts...)
			res, err := client.CallUnary(context.Background(), connect.NewRequest(wrapperspb.Bytes([]byte("hello"))))
			require.NoError(t, err)
			require.Equal(t, "hello", string(res.Msg.GetValue()))
			require.Equal(t, "xxxxx", res.Trailer().Get("x-echo-len"))

			_, err = client.CallUnary(context.Background(), connect.NewRequest(wrapperspb.Bytes([]byte("fail"))))
			require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err), "%v", err)

			big := bytes.Repeat([]byte("b"), 3<<20/2)
			res, err = client.CallUnary(context.Background(), connect.NewRequest(wrapperspb.Bytes(big)))
			require.NoError(t, err)
			require.True(t, bytes.Equal(big, res.Msg.GetValue()))
		})
	}
}

func TestStreaming(t *testing.T) {
	ts := newTestService()
	addr := startServer(t, &Server{Handler: ts.mux()})
	hc := h2cClient(t)
	for name, opts := range protocols {
		t.Run(name, func(t *testing.T) {
			ss := connect.NewClient[wrapperspb.BytesValue, wrapperspb.BytesValue](hc, "http://"+addr+serverPath, opts...)
			st, err := ss.CallServerStream(context.Background(), connect.NewRequest(wrapperspb.Bytes([]byte("s"))))
			require.NoError(t, err)
			n := 0
			for st.Receive() {
				require.Equal(t, "s", string(st.Msg().GetValue()))
				n++
			}
			require.NoError(t, st.Err())
			require.NoError(t, st.Close())
			require.Equal(t, 5, n)

			// Bidi with messages larger than both flow-control windows.
			bc := connect.NewClient[wrapperspb.BytesValue, wrapperspb.BytesValue](hc, "http://"+addr+bidiPath,
				append(opts, connect.WithReadMaxBytes(8<<20), connect.WithSendMaxBytes(8<<20))...)
			if name == "grpcweb" {
				return // gRPC-Web over HTTP/2 bidi works too, but connect's client refuses it
			}
			bs := bc.CallBidiStream(context.Background())
			for i, size := range []int{10, 200 << 10, 2 << 20, 1} {
				msg := bytes.Repeat([]byte{byte('a' + i)}, size)
				require.NoError(t, bs.Send(wrapperspb.Bytes(msg)))
				got, err := bs.Receive()
				require.NoError(t, err)
				require.True(t, bytes.Equal(msg, got.GetValue()), "message %d of %d bytes", i, size)
			}
			require.NoError(t, bs.CloseRequest())
			_, err = bs.Receive()
			require.ErrorIs(t, err, io.EOF)
			require.NoError(t, bs.CloseResponse())
		})
	}
}

func TestManyConcurrentStreams(t *testing.T) {
	ts := newTestService()
	addr := startServer(t, &Server{Handler: ts.mux()})
	hc := xClient(t)
	client := connect.NewClient[wrapperspb.BytesValue, wrapperspb.BytesValue](hc, "http://"+addr+unaryPath, connect.WithGRPC())
	var wg sync.WaitGroup
	var failed atomic.Int64
	for i := range 200 {
		wg.Go(func() {
			msg := bytes.Repeat([]byte{byte(i)}, 1+i*97)
			res, err := client.CallUnary(context.Background(), connect.NewRequest(wrapperspb.Bytes(msg)))
			if err != nil || !bytes.Equal(msg, res.Msg.GetValue()) {
				t.Logf("call %d: %v", i, err)
				failed.Add(1)
			}
		})
	}
	wg.Wait()
	require.Zero(t, failed.Load())
}

func TestRSTStreamCancelsHandlerContext(t *testing.T) {
	ts := newTestService()
	addr := startServer(t, &Server{Handler: ts.mux()})
	hc := h2cClient(t)
	bc := connect.NewClient[wrapperspb.BytesValue, wrapperspb.BytesValue](hc, "http://"+addr+bidiPath)
	ctx, cancel := context.WithCancel(context.Background())
	bs := bc.CallBidiStream(ctx)
	require.NoError(t, bs.Send(wrapperspb.Bytes([]byte("x"))))
	_, err := bs.Receive()
	require.NoError(t, err)
	cancel()
	_ = bs.CloseResponse() // the transport sends RST_STREAM(CANCEL)
	select {
	case cause := <-ts.cancelled:
		require.ErrorIs(t, cause, errStreamReset)
	case <-time.After(5 * time.Second):
		t.Fatal("handler context not cancelled by RST_STREAM")
	}
	_ = bs.CloseRequest()
	_ = bs.CloseResponse()
}

func TestShutdownLetsInFlightStreamsFinish(t *testing.T) {
	ts := newTestService()
	srv := &Server{Handler: ts.mux()}
	addr := startServer(t, srv)
	hc := h2cClient(t)
	client := connect.NewClient[wrapperspb.BytesValue, wrapperspb.BytesValue](hc, "http://"+addr+blockPath)
	res := make(chan error, 1)
	go func() {
		_, err := client.CallUnary(context.Background(), connect.NewRequest(wrapperspb.Bytes([]byte("in flight"))))
		res <- err
	}()
	<-ts.blockStart
	shut := make(chan error, 1)
	go func() { shut <- srv.Shutdown(context.Background()) }()
	// Shutdown is under way once it takes no new connections; it must
	// still be waiting for the handler.
	require.Eventually(t, func() bool {
		nc, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			_ = nc.Close()
		}
		return err != nil
	}, 5*time.Second, 5*time.Millisecond, "no new connections")
	select {
	case err := <-shut:
		t.Fatalf("Shutdown returned with a handler running: %v", err)
	default:
	}
	close(ts.released)
	require.NoError(t, <-res)
	select {
	case err := <-shut:
		require.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("Shutdown did not return after the handler finished")
	}
}

func TestShutdownDeadline(t *testing.T) {
	ts := newTestService()
	srv := &Server{Handler: ts.mux()}
	addr := startServer(t, srv)
	client := connect.NewClient[wrapperspb.BytesValue, wrapperspb.BytesValue](h2cClient(t), "http://"+addr+blockPath)
	res := make(chan error, 1)
	go func() {
		_, err := client.CallUnary(context.Background(), connect.NewRequest(wrapperspb.Bytes([]byte("stuck"))))
		res <- err
	}()
	<-ts.blockStart
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, srv.Shutdown(ctx), context.DeadlineExceeded)
	require.NoError(t, srv.Close())
	require.Error(t, <-res)
}

// rawClient speaks HTTP/2 frames by hand.
type rawClient struct {
	t    *testing.T
	nc   net.Conn
	fr   *http2.Framer
	henc *hpack.Encoder
	hbuf bytes.Buffer
}

func dialRaw(t *testing.T, addr string, settings ...http2.Setting) *rawClient {
	t.Helper()
	nc, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = nc.Close() })
	rc := &rawClient{t: t, nc: nc, fr: http2.NewFramer(nc, nc)}
	rc.fr.AllowIllegalWrites = true
	rc.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	rc.henc = hpack.NewEncoder(&rc.hbuf)
	_, err = io.WriteString(nc, http2.ClientPreface)
	require.NoError(t, err)
	require.NoError(t, rc.fr.WriteSettings(settings...))
	return rc
}

// next reads frames, acknowledging SETTINGS, until one matches keep.
func (rc *rawClient) next(keep func(http2.Frame) bool) http2.Frame {
	rc.t.Helper()
	_ = rc.nc.SetReadDeadline(time.Now().Add(5 * time.Second))
	for {
		f, err := rc.fr.ReadFrame()
		require.NoError(rc.t, err)
		if sf, ok := f.(*http2.SettingsFrame); ok && !sf.IsAck() {
			if v, ok := sf.Value(http2.SettingHeaderTableSize); ok {
				rc.henc.SetMaxDynamicTableSize(v) // as a compliant client must
			}
			_ = rc.fr.WriteSettingsAck() // the server may be closing
		}
		if keep(f) {
			return f
		}
	}
}

func (rc *rawClient) headers(id uint32, end bool, fields ...string) {
	rc.hbuf.Reset()
	for i := 0; i < len(fields); i += 2 {
		require.NoError(rc.t, rc.henc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]}))
	}
	require.NoError(rc.t, rc.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: rc.hbuf.Bytes(), EndStream: end, EndHeaders: true}))
}

func requestFields(path string, extra ...string) []string {
	return append([]string{":method", "POST", ":scheme", "http", ":authority", "x", ":path", path,
		"content-type", "application/proto"}, extra...)
}

func isGoAway(f http2.Frame) bool { _, ok := f.(*http2.GoAwayFrame); return ok }

func TestTrailersOnlyAndDeclaredTrailers(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Trailer", "X-Declared")
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusOK)
		w.Header().Set("X-Declared", "d")
		w.Header().Set(http.TrailerPrefix+"X-Prefixed", "p")
	})
	addr := startServer(t, &Server{Handler: h})
	res, err := h2cClient(t).Get("http://" + addr + "/")
	require.NoError(t, err)
	body, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	require.NoError(t, res.Body.Close())
	require.Empty(t, body)
	require.Equal(t, "text/plain", res.Header.Get("Content-Type"))
	require.Empty(t, res.Header.Get("X-Declared"))
	require.Equal(t, "d", res.Trailer.Get("X-Declared"))
	require.Equal(t, "p", res.Trailer.Get("X-Prefixed"))
}

func TestHealthAndReflectionOverGRPC(t *testing.T) {
	addr := startServer(t, &Server{Handler: newTestService().mux()})
	client := connect.NewClient[wrapperspb.StringValue, wrapperspb.StringValue](h2cClient(t), "http://"+addr+"/grpc.health.v1.Health/Check", connect.WithGRPC())
	// StringValue{1: "test.Echo"} has the wire form of HealthCheckRequest{service: "test.Echo"}.
	_, err := client.CallUnary(context.Background(), connect.NewRequest(wrapperspb.String("test.Echo")))
	require.NoError(t, err)
	_, err = client.CallUnary(context.Background(), connect.NewRequest(wrapperspb.String("nope")))
	require.Equal(t, connect.CodeNotFound, connect.CodeOf(err))

	// Reflection, as grpcurl uses it: a gRPC bidi stream.
	rs := grpcreflect.NewClient(h2cClient(t), "http://"+addr, connect.WithGRPC()).NewStream(context.Background())
	names, err := rs.ListServices()
	require.NoError(t, err)
	require.Contains(t, names, protoreflect.FullName("grpc.health.v1.Health"))
	files, err := rs.FileContainingSymbol("grpc.health.v1.Health")
	require.NoError(t, err)
	require.NotEmpty(t, files)
	_, err = rs.Close()
	require.NoError(t, err)
}

func TestTLS(t *testing.T) {
	ca := tlstest.NewCA(t)
	srvCert := ca.Server(t)
	clientCert := ca.Client(t, "n-1")
	var gotTLS atomic.Pointer[tls.ConnectionState]
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		gotTLS.Store(r.TLS)
		_, _ = io.WriteString(w, "ok")
	})
	addr := startServer(t, &Server{Handler: h, TLSConfig: &tls.Config{
		Certificates: []tls.Certificate{srvCert}, ClientCAs: ca.Pool(), ClientAuth: tls.RequireAndVerifyClientCert,
		MinVersion: tls.VersionTLS12,
	}})
	tr := &http2.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.Pool(), Certificates: []tls.Certificate{clientCert}, MinVersion: tls.VersionTLS12}}
	defer tr.CloseIdleConnections()
	res, err := (&http.Client{Transport: tr}).Get("https://" + addr + "/")
	require.NoError(t, err)
	body, _ := io.ReadAll(res.Body)
	_ = res.Body.Close()
	require.Equal(t, "ok", string(body))
	cs := gotTLS.Load()
	require.NotNil(t, cs)
	require.Equal(t, "h2", cs.NegotiatedProtocol)
	require.Equal(t, "n-1", cs.VerifiedChains[0][0].Subject.CommonName)
}

func TestWaitReadable(t *testing.T) {
	ready := make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		wr := r.Body.(interface{ WaitReadable() <-chan struct{} })
		select {
		case <-wr.WaitReadable():
			t.Error("readable before any data")
		default:
		}
		close(ready)
		<-wr.WaitReadable()
		b, _ := io.ReadAll(r.Body)
		_, _ = w.Write(b)
	})
	addr := startServer(t, &Server{Handler: h})
	pr, pw := io.Pipe()
	req, err := http.NewRequest(http.MethodPost, "http://"+addr+"/", pr)
	require.NoError(t, err)
	// The response body, read where the response arrives; nil without one.
	bodyCh := make(chan []byte, 1)
	go func() {
		res, err := h2cClient(t).Do(req)
		if err != nil {
			t.Error(err)
			bodyCh <- nil
			return
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		bodyCh <- b
	}()
	<-ready
	_, _ = pw.Write([]byte("late"))
	_ = pw.Close()
	b := <-bodyCh
	require.NotNil(t, b, "a response")
	require.Equal(t, "late", string(b))
}

// TestGRPCHealthProbe runs grpc-health-probe (grpc-go's client) when it is
// on PATH: go install github.com/grpc-ecosystem/grpc-health-probe@v0.4.63.
func TestGRPCHealthProbe(t *testing.T) {
	probe, err := exec.LookPath("grpc-health-probe")
	if err != nil {
		t.Skip("grpc-health-probe not on PATH")
	}
	addr := startServer(t, &Server{Handler: newTestService().mux()})
	out, err := exec.Command(probe, "-addr", addr, "-service", "test.Echo").CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "SERVING")
	out, err = exec.Command(probe, "-addr", addr, "-service", "nope").CombinedOutput()
	require.Error(t, err, "%s", out)
}
