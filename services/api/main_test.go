package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasehold/leasehold/pkg/apiauth"
	"github.com/leasehold/leasehold/pkg/daemon"
	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
	"github.com/leasehold/leasehold/services/api/internal/api"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func post(t *testing.T, c *http.Client, url, token, body string) (int, map[string]any) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := c.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	var out map[string]any
	require.NoError(t, json.Unmarshal(raw, &out), string(raw))
	return resp.StatusCode, out
}

// TestProcessServesAndStopsCleanly runs the built binary against an empty
// database: --migrate creates the schema, the tokens come from a file (one
// hashed) and LEASEHOLD_API_TOKENS, calls work over plain JSON, and SIGTERM
// exits 0. (Not parallel: it sets the environment the process inherits.)
func TestProcessServesAndStopsCleanly(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	db := pgtest.NewEmpty(t)
	const (
		admin    = "proc-admin-token-1234567890"
		operator = "proc-operator-token-1234567890"
		viewer   = "proc-viewer-token-1234567890"
	)
	tokens := filepath.Join(t.TempDir(), "tokens")
	require.NoError(t, os.WriteFile(tokens, []byte("# api tokens\nadmin:"+admin+"\noperator:"+apiauth.HashToken(operator)+"\n"), 0o600))
	t.Setenv(api.TokensEnv, "viewer:"+viewer)
	listen := fleettest.Addr(t)
	p := fleettest.StartService(t, "api", db.URL, "api_proc", "--migrate", "--listen-addr", listen, "--tokens-file", tokens)

	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	base := "http://" + listen + "/leasehold.control.v1.ControlService/"
	code, body := post(t, c, base+"RegisterNode", admin, `{"nodeId":"node-p","kind":"NODE_KIND_NODE"}`)
	require.Equal(t, http.StatusOK, code, body)
	cred, _ := body["credential"].(string)
	require.NotEmpty(t, cred)
	code, body = post(t, c, base+"CreateCommand", operator, `{"nodeId":"node-p","kind":"exec","payload":"eyJhcmd2IjpbInRydWUiXX0=","idempotencyKey":"once"}`)
	require.Equal(t, http.StatusOK, code, body)
	require.Equal(t, true, body["created"])
	code, body = post(t, c, base+"ListCommands", viewer, `{"nodeId":"node-p"}`)
	require.Equal(t, http.StatusOK, code, body)
	require.Len(t, body["commands"], 1)
	code, body = post(t, c, base+"CreatePool", viewer, `{"poolId":"p"}`)
	require.Equal(t, http.StatusForbidden, code, body)
	code, _ = post(t, c, base+"ListNodes", "nope-nope-nope-nope", `{}`)
	require.Equal(t, http.StatusUnauthorized, code)

	status, metrics, err := p.Get("/metrics", "")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, status)
	require.Contains(t, metrics, `leasehold_role{component="api"} 1`)
	require.Contains(t, metrics, `leasehold_api_requests_total{code="ok",procedure="/leasehold.control.v1.ControlService/RegisterNode"} 1`)
	require.Contains(t, metrics, `leasehold_api_requests_total{code="unauthenticated",procedure="/leasehold.control.v1.ControlService/ListNodes"} 1`)

	p.Signal(syscall.SIGTERM)
	require.Equal(t, 0, p.Wait(30*time.Second))
	logs := p.Logs()
	for _, secret := range []string{admin, operator, viewer, cred} {
		require.NotContains(t, logs, secret)
	}
	require.Contains(t, logs, "stopped cleanly")
}

// TestEndToEndCommandThroughGateway: a node registered through the api
// connects to a real gateway with its credential; a command created through
// the api is dispatched, executed by the node and waited for through the
// api; the read-only views show the gateway and its session.
func TestEndToEndCommandThroughGateway(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	t.Parallel()
	db := pgtest.NewDB(t)
	const admin = "e2e-admin-token-1234567890"
	tokens := filepath.Join(t.TempDir(), "tokens")
	require.NoError(t, os.WriteFile(tokens, []byte("admin:"+admin+"\n"), 0o600))
	gw := fleettest.StartGateway(t, db.URL, "gw_e2eapi", fleettest.FastGateway...)
	listen := fleettest.Addr(t)
	fleettest.StartService(t, "api", db.URL, "api_e2e", "--listen-addr", listen, "--tokens-file", tokens)

	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := controlv1connect.NewControlServiceClient(&http.Client{Transport: tr}, "http://"+listen,
		connect.WithInterceptors(connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
			return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
				req.Header().Set("Authorization", "Bearer "+admin)
				return next(ctx, req)
			}
		})))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	reg, err := client.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{NodeId: "e2e-1", Kind: nodev1.NodeKind_NODE_KIND_NODE, Labels: map[string]string{"role": "test"}}))
	require.NoError(t, err)

	var spec atomic.Pointer[nodev1.NodeSpec]
	d, err := daemon.New(daemon.Config{
		Address: gw.URL(), NodeID: "e2e-1", Credential: reg.Msg.GetCredential(),
		BackoffBase: 100 * time.Millisecond, BackoffMax: time.Second,
		OnSpec: func(s *nodev1.NodeSpec) { spec.Store(s) },
		Handler: func(_ context.Context, c *nodev1.Command) daemon.Outcome {
			return daemon.Outcome{Output: append([]byte("ran "), c.GetPayload()...)}
		},
	})
	require.NoError(t, err)
	dctx, stopDaemon := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(dctx) }()
	defer func() { stopDaemon(); <-done }()

	require.Eventually(t, func() bool {
		n, err := client.GetNode(ctx, connect.NewRequest(&controlv1.GetNodeRequest{NodeId: "e2e-1"}))
		return err == nil && n.Msg.GetNode().GetState() == controlv1.NodeState_NODE_STATE_CONNECTED
	}, 20*time.Second, 50*time.Millisecond)
	require.Equal(t, map[string]string{"role": "test"}, spec.Load().GetLabels(), "registration labels reach the node in its spec")

	cmd, err := client.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "e2e-1", Kind: "test.echo", Payload: []byte("uptime"), IdempotencyKey: "e2e"}))
	require.NoError(t, err)
	w, err := client.WaitCommand(ctx, connect.NewRequest(&controlv1.WaitCommandRequest{CommandId: cmd.Msg.GetCommand().GetId(), Timeout: durationpb.New(30 * time.Second)}))
	require.NoError(t, err)
	require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, w.Msg.GetCommand().GetState())
	require.Equal(t, []byte("ran uptime"), w.Msg.GetResult().GetOutput())
	require.GreaterOrEqual(t, w.Msg.GetCommand().GetDispatchCount(), int32(1))

	gws, err := client.ListGateways(ctx, connect.NewRequest(&controlv1.ListGatewaysRequest{}))
	require.NoError(t, err)
	require.Len(t, gws.Msg.GetGateways(), 1)
	require.Equal(t, "gw_e2eapi", gws.Msg.GetGateways()[0].GetId())
	require.True(t, gws.Msg.GetGateways()[0].GetLive())
	require.EqualValues(t, 1, gws.Msg.GetGateways()[0].GetSessions())
	leases, err := client.ListLeases(ctx, connect.NewRequest(&controlv1.ListLeasesRequest{NamePrefix: "gateway:"}))
	require.NoError(t, err)
	require.Equal(t, "gw_e2eapi", leases.Msg.GetLeases()[0].GetOwner())

	// Revoking the node through the api ends its session.
	_, err = client.RevokeNode(ctx, connect.NewRequest(&controlv1.RevokeNodeRequest{NodeId: "e2e-1"}))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		g, err := client.ListGateways(ctx, connect.NewRequest(&controlv1.ListGatewaysRequest{}))
		return err == nil && g.Msg.GetGateways()[0].GetSessions() == 0
	}, 20*time.Second, 100*time.Millisecond)
}

// TestProcessRefusesBadTokens: a malformed tokens file or none at all is a
// configuration error (exit 2) that names the problem, not the token.
func TestProcessRefusesBadTokens(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	t.Parallel()
	bin := proctest.Build(t, ".")
	bad := filepath.Join(t.TempDir(), "tokens")
	require.NoError(t, os.WriteFile(bad, []byte("root:some-secret-token-value\n"), 0o600))
	for name, args := range map[string][]string{
		"bad role":  {"--tokens-file", bad},
		"no tokens": {},
	} {
		p := proctest.Start(t, "api-"+name, bin, []string{"LEASEHOLD_API_TOKENS="},
			append([]string{"--database-url", "postgres://127.0.0.1:1/none", "--listen-addr", fleettest.Addr(t), "--http-addr", fleettest.Addr(t)}, args...)...)
		require.Equal(t, 2, p.Wait(30*time.Second), name)
		require.NotContains(t, p.Logs(), "some-secret-token-value")
		if name == "bad role" {
			require.Contains(t, p.Logs(), `unknown role "root"`)
		} else {
			require.Contains(t, p.Logs(), "no API tokens")
		}
	}
}

// TestTokenCreate: `leasehold-api token create` prints a fresh token and
// its hashed line; an api configured with only the hashed line accepts the
// token with that role, and refuses what the role may not do.
func TestTokenCreate(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	bin := proctest.Build(t, ".")
	run := func(args ...string) (int, string, string) {
		cmd := exec.Command(bin, args...)
		var out, errb strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &errb
		err := cmd.Run()
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			return ee.ExitCode(), out.String(), errb.String()
		}
		require.NoError(t, err)
		return 0, out.String(), errb.String()
	}
	code, _, errOut := run("token", "create")
	require.Equal(t, 2, code)
	require.Contains(t, errOut, "--role is required")
	code, _, errOut = run("token", "create", "--role", "root")
	require.Equal(t, 2, code)
	require.Contains(t, errOut, `unknown role "root"`)

	code, out, _ := run("token", "create", "--role", "viewer")
	require.Equal(t, 0, code)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 2, out)
	token, line := lines[0], lines[1]
	require.True(t, strings.HasPrefix(token, apiauth.TokenPrefix), token)
	require.Equal(t, "viewer:"+apiauth.HashToken(token), line)
	require.NotContains(t, line, token, "the config line never holds the token")
	_, again, _ := run("token", "create", "--role", "viewer")
	require.NotEqual(t, out, again)

	db := pgtest.NewDB(t)
	tokens := filepath.Join(t.TempDir(), "tokens")
	require.NoError(t, os.WriteFile(tokens, []byte(line+"\n"), 0o600))
	listen := fleettest.Addr(t)
	p := fleettest.StartService(t, "api", db.URL, "api_tok", "--listen-addr", listen, "--tokens-file", tokens)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	base := "http://" + listen + "/leasehold.control.v1.ControlService/"
	code, body := post(t, c, base+"ListNodes", token, `{}`)
	require.Equal(t, http.StatusOK, code, body)
	code, body = post(t, c, base+"CreatePool", token, `{"poolId":"p"}`)
	require.Equal(t, http.StatusForbidden, code, body)
	code, body = post(t, c, base+"ListNodes", token+"x", `{}`)
	require.Equal(t, http.StatusUnauthorized, code, body)
	require.NotContains(t, p.Logs(), token)
}
