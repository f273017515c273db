package e2e

import (
	"context"
	"crypto/rand"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/faultproxy"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
)

// TestTunnelCallerVanishes: a caller whose network goes silent (no FIN, no
// RST: a laptop closed, a NAT that forgot the flow) does not hold its
// tunnel, the node's tunnel slot and the target connection until the
// gateway's idle timeout (minutes): the api's HTTP/2 keep-alive finds the
// dead connection and the tunnel ends, its close audited, within seconds.
func TestTunnelCallerVanishes(t *testing.T) {
	t.Parallel()
	tokenFile := filepath.Join(t.TempDir(), "relay-token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(tunnelRelayToken+"\n"), 0o600))
	s := startRelayStack(t, "vanish", []string{"--gateway.relay-token-file", tokenFile}, []string{"--api.relay-token-file", tokenFile})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	s.echoes(ctx, t) // the node's session is up

	proxy, err := faultproxy.New(s.apiAddr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	viaProxy := controlClient{controlv1connect.NewControlServiceClient(h2cClient(), proxy.URL()), tunnelToken}
	st, opened, err := openTunnel(ctx, viaProxy, &controlv1.TunnelOpen{NodeId: s.node, Target: portTarget(s.echoPort)})
	require.NoError(t, err)
	payload := make([]byte, 1024)
	_, _ = rand.Read(payload)
	require.NoError(t, st.Send(&controlv1.OpenTunnelRequest{Data: payload}))
	for got := 0; got < len(payload); {
		m, err := st.Receive()
		require.NoError(t, err)
		got += len(m.GetData())
	}

	proxy.Blackhole()
	vanished := time.Now()
	require.Eventually(t, func() bool {
		var n int
		err := s.db.Pool.QueryRow(ctx, `SELECT count(*) FROM audit_events WHERE method = 'tunnel.close' AND detail->>'tunnel_id' = $1`,
			opened.GetTunnelId()).Scan(&n)
		return err == nil && n == 1
	}, 90*time.Second, 100*time.Millisecond, "the tunnel of a vanished caller is still open (its close is not audited)")
	t.Logf("tunnel of a vanished caller closed %s after its network went silent", time.Since(vanished).Round(100*time.Millisecond))
	_ = st.CloseResponse()
}
