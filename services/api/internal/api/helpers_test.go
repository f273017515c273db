package api

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/grafana/dskit/services"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const (
	adminToken    = "admin-token-4f9c1d2e7a"
	operatorToken = "operator-token-8b3e6f0c5d"
	viewerToken   = "viewer-token-2a7d9e4b1f"
)

// bundle is one test's api: a fresh database, the service on a real
// loopback port, and generated clients for each role.
type bundle struct {
	t        *testing.T
	db       *pgtest.DB
	svc      *Service
	base     string
	reg      *prometheus.Registry
	logs     *proctest.Buffer
	http     *http.Client
	admin    controlv1connect.ControlServiceClient
	operator controlv1connect.ControlServiceClient
	viewer   controlv1connect.ControlServiceClient
	anon     controlv1connect.ControlServiceClient

	mu      sync.Mutex
	secrets []string
}

func setup(t *testing.T, opts ...func(*Config, *http.Transport)) *bundle {
	t.Helper()
	return setupWith(t, nil, opts...)
}

// setupWith is setup with deps adjusting the service's dependencies.
func setupWith(t *testing.T, deps func(*Deps), opts ...func(*Config, *http.Transport)) *bundle {
	t.Helper()
	db := pgtest.NewDB(t)
	cfg := Config{
		ListenAddr:            "127.0.0.1:0",
		Tokens:                "admin:" + adminToken + ",operator:" + operatorToken + "\nviewer:" + viewerToken,
		MaxMessageBytes:       4 << 20,
		MaxPayloadBytes:       maxPayloadBytes,
		DefaultCommandTimeout: time.Hour,
		CreateGroup:           DefaultCreateGroup,
		WaitPollInterval:      20 * time.Millisecond,
		ShutdownGrace:         5 * time.Second,
	}
	tr := &http.Transport{}
	for _, o := range opts {
		o(&cfg, tr)
	}
	require.NoError(t, cfg.Validate())
	logs := &proctest.Buffer{}
	reg := prometheus.NewRegistry()
	d := Deps{DB: db.Pool, NotifyURL: db.DirectURL, Logger: slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})), Registry: reg}
	if deps != nil {
		deps(&d)
	}
	svc, err := New(cfg, d)
	require.NoError(t, err)
	// The service runs until stopped: its start context must outlive setup.
	require.NoError(t, services.StartAndAwaitRunning(context.Background(), svc))
	scheme := "http://"
	if cfg.TLSCert != "" {
		scheme = "https://"
	}
	b := &bundle{
		t: t, db: db, svc: svc, base: scheme + svc.Addr(), reg: reg, logs: logs,
		http:    &http.Client{Transport: tr, Timeout: 70 * time.Second},
		secrets: []string{adminToken, operatorToken, viewerToken},
	}
	b.admin, b.operator, b.viewer, b.anon = b.client(adminToken), b.client(operatorToken), b.client(viewerToken), b.client("")
	t.Cleanup(func() {
		require.NoError(t, services.StopAndAwaitTerminated(context.Background(), svc))
		tr.CloseIdleConnections()
		out := logs.String()
		if t.Failed() {
			t.Logf("api logs:\n%s", out)
		}
		b.mu.Lock()
		defer b.mu.Unlock()
		for _, s := range b.secrets {
			require.NotContains(t, out, s, "a secret reached the logs")
		}
	})
	return b
}

// secret records a value that must never appear in the logs.
func (b *bundle) secret(s string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.secrets = append(b.secrets, s)
}

// bearer sets the token on unary and streaming calls.
type bearer string

func (tok bearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if tok != "" {
			req.Header().Set("Authorization", "Bearer "+string(tok))
		}
		return next(ctx, req)
	}
}

func (tok bearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		if tok != "" {
			conn.RequestHeader().Set("Authorization", "Bearer "+string(tok))
		}
		return conn
	}
}

func (tok bearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

func (b *bundle) client(token string, opts ...connect.ClientOption) controlv1connect.ControlServiceClient {
	return controlv1connect.NewControlServiceClient(b.http, b.base, append([]connect.ClientOption{connect.WithInterceptors(bearer(token))}, opts...)...)
}

// postJSON is what curl does: a JSON POST to /<service>/<method>.
func (b *bundle) postJSON(procedure, token, body string) (int, map[string]any) {
	b.t.Helper()
	req, err := http.NewRequest(http.MethodPost, b.base+procedure, strings.NewReader(body))
	require.NoError(b.t, err)
	req.Header.Set("Content-Type", "application/json")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := b.http.Do(req)
	require.NoError(b.t, err)
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	require.NoError(b.t, err)
	var out map[string]any
	require.NoError(b.t, json.Unmarshal(raw, &out), string(raw))
	return resp.StatusCode, out
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// requireCode asserts that err is a Connect error with code.
func requireCode(t *testing.T, err error, code connect.Code, msgAndArgs ...any) {
	t.Helper()
	_ = requireConnectError(t, err, code, msgAndArgs...)
}

// requireConnectError asserts that err is a Connect error with code and
// returns it, for assertions on its message and details.
func requireConnectError(t *testing.T, err error, code connect.Code, msgAndArgs ...any) *connect.Error {
	t.Helper()
	require.Error(t, err, msgAndArgs...)
	var ce *connect.Error
	require.ErrorAs(t, err, &ce, msgAndArgs...)
	require.Equal(t, code, ce.Code(), append([]any{"error: %v"}, err)...)
	return ce
}

func (b *bundle) registerNode(id string, labels map[string]string) string {
	b.t.Helper()
	resp, err := b.admin.RegisterNode(ctxT(b.t), connect.NewRequest(&controlv1.RegisterNodeRequest{
		NodeId: id, Kind: nodev1.NodeKind_NODE_KIND_NODE, Labels: labels,
	}))
	require.NoError(b.t, err)
	b.secret(resp.Msg.GetCredential())
	return resp.Msg.GetCredential()
}

func (b *bundle) exec(sql string, args ...any) {
	b.t.Helper()
	_, err := b.db.Pool.Exec(ctxT(b.t), sql, args...)
	require.NoError(b.t, err)
}

func (b *bundle) count(sql string, args ...any) int {
	b.t.Helper()
	var n int
	require.NoError(b.t, b.db.Pool.QueryRow(ctxT(b.t), sql, args...).Scan(&n))
	return n
}

// rowCounts counts the rows of every table the API writes.
func (b *bundle) rowCounts() map[string]int {
	b.t.Helper()
	out := map[string]int{}
	for _, table := range []string{"nodes", "node_credentials", "node_sessions", "commands", "pools", "pool_leases",
		"node_allocations", "sinks", "sink_cursors", "work_queue", "audit_events"} {
		out[table] = b.count("SELECT count(*) FROM " + table)
	}
	return out
}

func contextWithTimeout(parent context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(parent, d)
}

func (b *bundle) svcMetric(procedure, code string) prometheus.Counter {
	mfs, err := b.reg.Gather()
	require.NoError(b.t, err)
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "x"})
	for _, mf := range mfs {
		if mf.GetName() != "leasehold_api_requests_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["procedure"] == procedure && labels["code"] == code {
				c.Add(m.GetCounter().GetValue())
			}
		}
	}
	return c
}

// waitingCommands reads leasehold_api_wait_commands: how many commands
// WaitCommand calls are waiting for right now.
func (b *bundle) waitingCommands() float64 {
	mfs, err := b.reg.Gather()
	if err != nil {
		return 0
	}
	for _, mf := range mfs {
		if mf.GetName() == "leasehold_api_wait_commands" && len(mf.GetMetric()) == 1 {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	return 0
}
