package tracing_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/pkg/tracing"
)

// otelEnv is every variable Setup reads to choose and configure its
// exporter; each test sets all of them, so the machine's own environment
// does not leak in.
var otelEnv = []string{
	"OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER",
	"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
	"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
}

func setOTelEnv(t *testing.T, env map[string]string) {
	t.Helper()
	for _, k := range otelEnv {
		t.Setenv(k, env[k])
	}
	// Setup installs its provider as the global one.
	prev := otel.GetTracerProvider()
	t.Cleanup(func() { otel.SetTracerProvider(prev) })
}

// TestUnsupportedValueNamesTheVariable: an exporter or an OTLP protocol
// leasehold does not link fails Setup with the variable and its value, so
// the operator knows which line of the environment to fix.
func TestUnsupportedValueNamesTheVariable(t *testing.T) {
	for _, c := range []struct {
		env       map[string]string
		variable  string
		supported string
	}{
		{map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}, `OTEL_TRACES_EXPORTER="zipkin"`, "otlp, console or none"},
		{map[string]string{"OTEL_TRACES_EXPORTER": "otlp,console"}, `OTEL_TRACES_EXPORTER="otlp,console"`, "otlp, console or none"},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
			`OTEL_EXPORTER_OTLP_PROTOCOL="http/json"`, "http/protobuf or grpc"},
		{map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "thrift"},
			`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="thrift"`, "http/protobuf or grpc"},
	} {
		setOTelEnv(t, c.env)
		p, err := tracing.Setup(context.Background(), "api", "api_1")
		require.Error(t, err, "%v", c.env)
		require.Nil(t, p)
		require.Contains(t, err.Error(), c.variable)
		require.Contains(t, err.Error(), c.supported)
	}
}

// TestNoneDisables: OTEL_TRACES_EXPORTER=none (any case, any surrounding
// space) turns tracing off even with an endpoint set, and so does
// OTEL_SDK_DISABLED=true with an exporter named; a protocol that would be
// refused is then never looked at.
func TestNoneDisables(t *testing.T) {
	for _, env := range []map[string]string{
		{"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"},
		{"OTEL_TRACES_EXPORTER": " None ", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"},
		{"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
		{"OTEL_TRACES_EXPORTER": "zipkin", "OTEL_SDK_DISABLED": "TRUE"},
	} {
		setOTelEnv(t, env)
		require.False(t, tracing.Enabled(), "%v", env)
		p, err := tracing.Setup(context.Background(), "api", "api_1")
		require.NoError(t, err, "%v", env)
		require.False(t, p.Enabled, "%v", env)
		_, span := p.Tracer("x").Start(context.Background(), "noop")
		require.False(t, span.SpanContext().IsValid(), "off, spans are no-ops (%v)", env)
		require.NoError(t, p.Shutdown(context.Background()))
	}
}

// TestEachSupportedExporterStarts: every value the documentation lists
// gives a running provider (nothing is exported: no span is started).
func TestEachSupportedExporterStarts(t *testing.T) {
	for _, env := range []map[string]string{
		{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"},
		{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
		{"OTEL_TRACES_EXPORTER": "OTLP", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"},
		{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
		{"OTEL_TRACES_EXPORTER": "console"},
	} {
		setOTelEnv(t, env)
		p, err := tracing.Setup(context.Background(), "api", "api_1")
		require.NoError(t, err, "%v", env)
		require.True(t, p.Enabled, "%v", env)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		require.NoError(t, p.Shutdown(ctx), "%v", env)
		cancel()
	}
}

// traceReceiver keeps the names of the spans an OTLP receiver is sent.
type traceReceiver struct {
	coltracepb.UnimplementedTraceServiceServer
	mu    sync.Mutex
	names []string
}

func (r *traceReceiver) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				r.names = append(r.names, s.GetName())
			}
		}
	}
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

func (r *traceReceiver) got() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.names...)
}

// exportOneSpan sets tracing up from env, ends one span and flushes it.
func exportOneSpan(t *testing.T, env map[string]string, name string) {
	t.Helper()
	setOTelEnv(t, env)
	p, err := tracing.Setup(context.Background(), "api", "api_1")
	require.NoError(t, err)
	require.True(t, p.Enabled)
	_, span := p.Tracer("test").Start(context.Background(), name)
	span.End()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, p.Shutdown(ctx))
}

// TestOTLPExportsOverBothProtocols: a span reaches an OTLP receiver over
// http/protobuf (the default) and over grpc, configured by the standard
// endpoint variables alone.
func TestOTLPExportsOverBothProtocols(t *testing.T) {
	t.Run("http/protobuf", func(t *testing.T) {
		recv := &traceReceiver{}
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			raw, err := io.ReadAll(req.Body)
			var msg coltracepb.ExportTraceServiceRequest
			if err == nil {
				err = proto.Unmarshal(raw, &msg)
			}
			if err != nil || req.URL.Path != "/v1/traces" {
				http.Error(w, "want an OTLP protobuf trace export on /v1/traces", http.StatusBadRequest)
				return
			}
			resp, _ := recv.Export(req.Context(), &msg)
			out, _ := proto.Marshal(resp)
			w.Header().Set("Content-Type", "application/x-protobuf")
			_, _ = w.Write(out)
		}))
		defer srv.Close()
		exportOneSpan(t, map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": srv.URL}, "over-http")
		require.Equal(t, []string{"over-http"}, recv.got())
	})
	t.Run("grpc", func(t *testing.T) {
		recv := &traceReceiver{}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		srv := grpc.NewServer()
		coltracepb.RegisterTraceServiceServer(srv, recv)
		done := make(chan struct{})
		go func() { defer close(done); _ = srv.Serve(ln) }()
		defer func() { srv.Stop(); <-done }()
		exportOneSpan(t, map[string]string{
			"OTEL_EXPORTER_OTLP_PROTOCOL":        "grpc",
			"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://" + ln.Addr().String(),
		}, "over-grpc")
		require.Equal(t, []string{"over-grpc"}, recv.got())
	})
}
