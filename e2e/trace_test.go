package e2e

import (
	"compress/gzip"
	"context"
	"encoding/hex"
	"io"
	"net"
	"net/http"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/leasehold/leasehold/pkg/daemon"
	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

// span is what the receiver keeps of an exported span.
type span struct {
	service, name, trace, id, parent string
}

// otlpReceiver is an OTLP/HTTP trace endpoint on loopback that keeps every
// span it is sent.
type otlpReceiver struct {
	url   string
	mu    sync.Mutex
	spans []span
}

func startReceiver(t *testing.T) *otlpReceiver {
	t.Helper()
	r := &otlpReceiver{}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		var body io.Reader = req.Body
		if req.Header.Get("Content-Encoding") == "gzip" {
			zr, err := gzip.NewReader(req.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			body = zr
		}
		raw, err := io.ReadAll(io.LimitReader(body, 16<<20))
		var msg coltracepb.ExportTraceServiceRequest
		if err == nil {
			err = proto.Unmarshal(raw, &msg)
		}
		if err != nil || req.URL.Path != "/v1/traces" {
			http.Error(w, "want an OTLP protobuf trace export on /v1/traces", http.StatusBadRequest)
			return
		}
		r.mu.Lock()
		for _, rs := range msg.GetResourceSpans() {
			var service string
			for _, a := range rs.GetResource().GetAttributes() {
				if a.GetKey() == "service.name" {
					service = a.GetValue().GetStringValue()
				}
			}
			for _, ss := range rs.GetScopeSpans() {
				for _, s := range ss.GetSpans() {
					r.spans = append(r.spans, span{service: service, name: s.GetName(), trace: hex.EncodeToString(s.GetTraceId()),
						id: hex.EncodeToString(s.GetSpanId()), parent: hex.EncodeToString(s.GetParentSpanId())})
				}
			}
		}
		r.mu.Unlock()
		w.Header().Set("Content-Type", "application/x-protobuf")
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		_, _ = w.Write(out)
	})}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close(); <-done })
	r.url = "http://" + ln.Addr().String()
	return r
}

func (r *otlpReceiver) find(name string) []span {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []span
	for _, s := range r.spans {
		if s.name == name {
			out = append(out, s)
		}
	}
	return out
}

// TestTraceFromCreateCommandToNodeResult runs the api and a gateway as real
// processes with tracing turned on by the standard OTEL_* environment only,
// exporting OTLP to a receiver in the test. A CreateCommand and the node's
// result share one trace: the api's server span, its SQL, and the gateway's
// dispatch and result spans (children of the call, across processes, through
// commands.traceparent).
func TestTraceFromCreateCommandToNodeResult(t *testing.T) {
	t.Parallel()
	recv := startReceiver(t)
	db := pgtest.NewDB(t)
	ids, creds := fleettest.RegisterNodes(t, db.Pool, "tr", 1)
	const token = "e2e-trace-operator-token-1"
	env := []string{
		"OTEL_EXPORTER_OTLP_ENDPOINT=" + recv.url, "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf",
		"OTEL_BSP_SCHEDULE_DELAY=100", "OTEL_TRACES_EXPORTER=", "OTEL_SDK_DISABLED=",
		"LEASEHOLD_API_TOKENS=operator:" + token,
	}
	start := func(service, name string, extra ...string) *proctest.Proc {
		args := append([]string{"--database-url", db.URL, "--http-addr", fleettest.Addr(t), "--id", name, "--log-format", "text"},
			fleettest.DBFlags(db.URL)...)
		p := proctest.Start(t, name, fleettest.Binary(t, service), env, append(args, extra...)...)
		p.WaitReady(60 * time.Second)
		return p
	}
	gwAddr, apiAddr := fleettest.Addr(t), fleettest.Addr(t)
	gw := start("gateway", "gw_trace", append([]string{"--listen-addr", gwAddr}, fleettest.FastGateway...)...)
	api := start("api", "api_trace", "--listen-addr", apiAddr)
	require.Contains(t, gw.Logs(), "OpenTelemetry tracing on")

	d, err := daemon.New(daemon.Config{Address: "http://" + gwAddr, NodeID: ids[0], Credential: creds[0],
		Handler: func(context.Context, *nodev1.Command) daemon.Outcome { return daemon.Outcome{Output: []byte("ok")} }})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = d.Run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait() })

	client := controlv1connect.NewControlServiceClient(http.DefaultClient, "http://"+apiAddr)
	req := connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: ids[0], Kind: "exec", Payload: []byte(`{"argv":["true"]}`)})
	req.Header().Set("Authorization", "Bearer "+token)
	callCtx, callCancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer callCancel()
	created, err := client.CreateCommand(callCtx, req)
	require.NoError(t, err)
	id := created.Msg.GetCommand().GetId()
	require.Eventually(t, func() bool {
		n, err := queryInt(db.Pool, `SELECT count(*) FROM commands WHERE id = $1 AND state = 'succeeded'`, id)
		return err == nil && n == 1
	}, 60*time.Second, 50*time.Millisecond, "the node's result is stored")

	// Spans are exported in batches every 100ms; SIGTERM flushes the rest.
	gw.Signal(syscall.SIGTERM)
	api.Signal(syscall.SIGTERM)
	require.Zero(t, gw.Wait(60*time.Second))
	require.Zero(t, api.Wait(60*time.Second))

	calls := recv.find(controlv1connect.ControlServiceCreateCommandProcedure[1:])
	require.Len(t, calls, 1, "the api's CreateCommand server span")
	call := calls[0]
	require.Equal(t, "leasehold-api", call.service)
	for _, name := range []string{"leasehold.gateway.dispatch", "leasehold.gateway.result"} {
		got := recv.find(name)
		require.Len(t, got, 1, name)
		require.Equal(t, "leasehold-gateway", got[0].service, name)
		require.Equal(t, call.trace, got[0].trace, "%s is in the CreateCommand trace", name)
		require.Equal(t, call.id, got[0].parent, "%s is a child of the CreateCommand span", name)
	}
	recv.mu.Lock()
	defer recv.mu.Unlock()
	var sql int
	for _, s := range recv.spans {
		if s.service == "leasehold-api" && s.parent == call.id {
			sql++
		}
		if s.service == "leasehold-gateway" && s.trace != call.trace {
			t.Errorf("a gateway span outside a traced command: %+v (the background loops start no traces)", s)
		}
	}
	require.NotZero(t, sql, "the api's queries are children of the call (otelpgx)")
}
