package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

// TestNodeAgentTunnels opens tunnels through the api and a gateway's relay
// to real leasehold-node processes configured by their flags alone: with
// --tunnel.ports listing two loopback echo servers, bytes round-trip
// through either; a third echo server, listening but not listed, is
// refused PERMISSION_DENIED naming the allowlist; --tunnel.shell, a path
// with an argument ("/bin/sh -f"), runs that shell with that argument as
// the agent's user and runs echo in it; --tunnel.shell-user runs it as
// another user (as root only); an agent without --tunnel.ports refuses
// every port.
func TestNodeAgentTunnels(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ids, creds := fleettest.RegisterNodes(t, db.Pool, "agtun", 2)
	gw, tun := startRelayedPlane(t, db, "agent_tun", "tunnel", tunnelToken)

	allowedA, allowedB, unlisted := echoServer(t), echoServer(t), echoServer(t)
	// startAgent needs only an address that reaches the gateway (here the
	// gateway itself) and a directory for the agents' state.
	s := &agentStack{db: db, lb: gw.Listen, root: t.TempDir()}
	s.startAgent(t, ids[0], creds[0], "--tunnel.ports", fmt.Sprintf("%d, %d", allowedA, allowedB), "--tunnel.shell", "/bin/sh -f")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	t.Run("bytes round-trip through both allowed ports", func(t *testing.T) {
		for _, port := range []uint32{allowedA, allowedB} {
			st, opened, err := openTunnel(ctx, tun, &controlv1.TunnelOpen{NodeId: ids[0], Target: portTarget(port)})
			require.NoError(t, err, "port %d", port)
			require.Equal(t, "gw_agent_tun", opened.GetGatewayId())
			payload := make([]byte, 200<<10) // more than one HTTP/2 window
			_, _ = rand.Read(payload)
			got, err := roundTrip(st, payload)
			require.NoError(t, err, "port %d", port)
			require.True(t, bytes.Equal(payload, got), "port %d echoed %d bytes, sent %d", port, len(got), len(payload))
			_ = st.CloseResponse()
		}
	})

	t.Run("a listening port not on the allowlist is refused", func(t *testing.T) {
		_, _, err := openTunnel(ctx, tun, &controlv1.TunnelOpen{NodeId: ids[0], Target: portTarget(unlisted)})
		require.Equal(t, connect.CodePermissionDenied, connect.CodeOf(err), "%v", err)
		require.ErrorContains(t, err, fmt.Sprintf("port %d is not in node %s's tunnel allowlist", unlisted, ids[0]))
	})

	t.Run("the shell runs with its argument as the agent's user", func(t *testing.T) {
		st, _, err := openTunnel(ctx, tun, &controlv1.TunnelOpen{NodeId: ids[0], Target: &controlv1.TunnelTarget{Kind: &controlv1.TunnelTarget_Shell{Shell: true}}})
		require.NoError(t, err)
		got, err := roundTrip(st, []byte("echo \"tunnel-$((6*7))\"\ncase $- in *f*) echo noglob ;; *) echo glob ;; esac\nid -u\n"))
		require.NoError(t, err)
		require.Equal(t, fmt.Sprintf("tunnel-42\nnoglob\n%d\n", os.Geteuid()), string(got))
		_ = st.CloseResponse()
	})

	t.Run("--tunnel.shell-user runs the shell as that user; no --tunnel.ports refuses every port", func(t *testing.T) {
		if os.Geteuid() != 0 {
			t.Skip("running the shell as another user needs root")
		}
		nobody, err := user.Lookup("nobody")
		require.NoError(t, err)
		s.startAgent(t, ids[1], creds[1], "--tunnel.shell", "/bin/sh", "--tunnel.shell-user", "nobody")
		st, _, err := openTunnel(ctx, tun, &controlv1.TunnelOpen{NodeId: ids[1], Target: &controlv1.TunnelTarget{Kind: &controlv1.TunnelTarget_Shell{Shell: true}}})
		require.NoError(t, err)
		got, err := roundTrip(st, []byte("echo \"tunnel-$((6*7))\"\nid -u\nid -un\n"))
		require.NoError(t, err)
		require.Equal(t, fmt.Sprintf("tunnel-42\n%s\nnobody\n", nobody.Uid), string(got))
		_ = st.CloseResponse()

		_, _, err = openTunnel(ctx, tun, &controlv1.TunnelOpen{NodeId: ids[1], Target: portTarget(allowedA)})
		require.Equal(t, connect.CodePermissionDenied, connect.CodeOf(err), "%v", err)
		require.ErrorContains(t, err, "allowlist")
	})
}

// startRelayedPlane runs a gateway gw_<name> with a relay listener and an
// api api_<name> that dials it with the shared relay token, as tunnels and
// live output past the stored cap need, for real leasehold-node processes
// that dial the gateway; the api accepts token as role. gwExtra are more
// gateway flags.
func startRelayedPlane(t *testing.T, db *pgtest.DB, name, role, token string, gwExtra ...string) (fleettest.Gateway, controlClient) {
	t.Helper()
	tokenFile := filepath.Join(t.TempDir(), "relay-token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(tunnelRelayToken+"\n"), 0o600))
	gw := fleettest.StartGateway(t, db.URL, "gw_"+name, append(append([]string{"--gateway.relay-listen-addr", fleettest.Addr(t),
		"--gateway.relay-token-file", tokenFile}, gwExtra...), fleettest.FastGateway...)...)
	apiAddr := fleettest.Addr(t)
	api := proctest.Start(t, "api_"+name, fleettest.Binary(t, "api"), []string{"LEASEHOLD_API_TOKENS=" + role + ":" + token},
		append([]string{"--database-url", db.URL, "--http-addr", fleettest.Addr(t), "--id", "api_" + name, "--log-format", "text",
			"--listen-addr", apiAddr, "--api.relay-token-file", tokenFile}, fleettest.DBFlags(db.URL)...)...)
	api.WaitReady(60 * time.Second)
	return gw, controlClient{controlv1connect.NewControlServiceClient(h2cClient(), "http://"+apiAddr), token}
}
