package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/daemon"
	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	relayv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/relay/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/relay/v1/relayv1connect"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
	"github.com/leasehold/leasehold/pkg/tlstest"
)

// relayStack is one gateway with a relay, an api that dials it, and a
// daemon with an echo port in its allowlist.
type relayStack struct {
	db        *pgtest.DB
	node      string
	relayAddr string
	apiAddr   string
	echoPort  uint32
	tun       controlClient
}

// startRelayStack starts the stack with the gateway's and the api's
// relay flags.
func startRelayStack(t *testing.T, prefix string, gatewayRelay, apiRelay []string) *relayStack {
	t.Helper()
	db := pgtest.NewDB(t)
	ids, creds := fleettest.RegisterNodes(t, db.Pool, prefix, 1)
	env := []string{"LEASEHOLD_API_TOKENS=tunnel:" + tunnelToken}
	start := func(service, name string, extra ...string) {
		args := append([]string{"--database-url", db.URL, "--http-addr", fleettest.Addr(t), "--id", name, "--log-format", "text"},
			fleettest.DBFlags(db.URL)...)
		p := proctest.Start(t, name, fleettest.Binary(t, service), env, append(args, extra...)...)
		p.WaitReady(60 * time.Second)
	}
	gwAddr, relayAddr, apiAddr := fleettest.Addr(t), fleettest.Addr(t), fleettest.Addr(t)
	start("gateway", "gw_"+prefix, append(append([]string{"--listen-addr", gwAddr, "--gateway.relay-listen-addr", relayAddr,
		"--tls-reload-interval", "100ms"}, gatewayRelay...), fleettest.FastGateway...)...)
	start("api", "api_"+prefix, append([]string{"--listen-addr", apiAddr, "--api.reload-interval", "100ms"}, apiRelay...)...)

	echo := echoServer(t)
	d, err := daemon.New(daemon.Config{Address: "http://" + gwAddr, NodeID: ids[0], Credential: creds[0],
		Handler:     func(context.Context, *nodev1.Command) daemon.Outcome { return daemon.Outcome{} },
		BackoffBase: 50 * time.Millisecond, BackoffMax: 500 * time.Millisecond, TunnelPorts: []uint32{echo}})
	require.NoError(t, err)
	dctx, dcancel := context.WithCancel(context.Background())
	var dwg sync.WaitGroup
	dwg.Go(func() { _ = d.Run(dctx) })
	t.Cleanup(func() { dcancel(); dwg.Wait() })
	cc := controlv1connect.NewControlServiceClient(h2cClient(), "http://"+apiAddr)
	return &relayStack{db: db, node: ids[0], relayAddr: relayAddr, apiAddr: apiAddr, echoPort: echo, tun: controlClient{cc, tunnelToken}}
}

// echoes opens a tunnel through the api (retrying UNAVAILABLE until the
// node's session is up, and the codes in retry) and checks bytes
// round-trip.
func (s *relayStack) echoes(ctx context.Context, t *testing.T, retry ...connect.Code) {
	t.Helper()
	var last error
	for ctx.Err() == nil {
		st, _, err := openTunnel(ctx, s.tun, &controlv1.TunnelOpen{NodeId: s.node, Target: portTarget(s.echoPort)})
		if err == nil {
			payload := make([]byte, 64<<10)
			_, _ = rand.Read(payload)
			got, err := roundTrip(st, payload)
			require.NoError(t, err)
			require.True(t, bytes.Equal(payload, got), "echoed %d bytes, sent %d", len(got), len(payload))
			_ = st.CloseResponse()
			return
		}
		if code := connect.CodeOf(err); code != connect.CodeUnavailable && !slices.Contains(retry, code) {
			require.NoError(t, err, "only UNAVAILABLE (no session yet) and %v are retried", retry)
		}
		last = err
		time.Sleep(100 * time.Millisecond) // poll interval of a loop bounded by ctx
	}
	t.Fatalf("no tunnel within the test's deadline: %v", last)
}

// relayCall opens RelayTunnel directly on the relay with client and token
// and returns the error of its first answer.
func (s *relayStack) relayCall(ctx context.Context, client *http.Client, url, token string) error {
	rs := relayv1connect.NewGatewayRelayServiceClient(client, url).RelayTunnel(ctx)
	if token != "" {
		rs.RequestHeader().Set("Authorization", "Bearer "+token)
	}
	_ = rs.Send(&relayv1.RelayTunnelRequest{Open: &relayv1.RelayOpen{NodeId: s.node, Target: portTarget(s.echoPort), Actor: "mallory"}})
	_, err := rs.Receive()
	_ = rs.CloseResponse()
	return err
}

// tlsClient speaks HTTP/2 over TLS, trusting ca, presenting cert (if any).
func tlsClient(ca *tlstest.CA, cert *tls.Certificate) *http.Client {
	c := &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: ca.Pool(), NextProtos: []string{"h2"}}
	if cert != nil {
		c.Certificates = []tls.Certificate{*cert}
	}
	p := new(http.Protocols)
	p.SetHTTP2(true)
	return &http.Client{Transport: &http.Transport{Protocols: p, TLSClientConfig: c}}
}

// TestTunnelRelayMutualTLS: the relay is served over TLS and authenticates
// the api by its client certificate alone (no shared token): a tunnel
// opened through the api round-trips; a caller without a certificate, one
// whose certificate names someone else (signed by the same CA), and one
// speaking plaintext are all refused before any tunnel opens.
func TestTunnelRelayMutualTLS(t *testing.T) {
	t.Parallel()
	ca := tlstest.NewCA(t)
	caFile := ca.WriteCA(t)
	relayCert, relayKey := tlstest.WriteKeyPair(t, ca.Server(t))
	apiCert, apiKey := tlstest.WriteKeyPair(t, ca.Client(t, "leasehold-api"))
	s := startRelayStack(t, "rtls",
		[]string{"--gateway.relay-tls.cert-file", relayCert, "--gateway.relay-tls.key-file", relayKey, "--gateway.relay-tls.client-ca-file", caFile},
		[]string{"--api.relay-tls.ca-file", caFile, "--api.relay-tls.cert-file", apiCert, "--api.relay-tls.key-file", apiKey})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	s.echoes(ctx, t)

	url := "https://" + s.relayAddr
	require.Error(t, s.relayCall(ctx, tlsClient(ca, nil), url, ""), "no client certificate: the handshake fails")
	other := ca.Client(t, "leasehold-gateway")
	err := s.relayCall(ctx, tlsClient(ca, &other), url, "")
	require.Equal(t, connect.CodeUnauthenticated, connect.CodeOf(err), "a certificate of the same CA naming someone else: %v", err)
	require.Error(t, s.relayCall(ctx, h2cClient(), "http://"+s.relayAddr, ""), "plaintext is not served")

	var opens int
	require.NoError(t, s.db.Pool.QueryRow(ctx, `SELECT count(*) FROM audit_events WHERE method = 'tunnel.open' AND outcome = 'ok'`).Scan(&opens))
	require.Equal(t, 1, opens, "only the api's tunnel opened")
	s.requireRelayAudit(ctx, t, "certificate:leasehold-api")
}

// requireRelayAudit checks the gateway's own audit rows of the one tunnel
// opened through the api: relay.open and relay.close, with the api's
// caller as actor, how the relay authenticated the api, and the bytes.
func (s *relayStack) requireRelayAudit(ctx context.Context, t *testing.T, caller string) {
	t.Helper()
	require.Eventually(t, func() bool {
		var n int
		err := s.db.Pool.QueryRow(ctx, `SELECT count(*) FROM audit_events WHERE method = 'relay.close'`).Scan(&n)
		return err == nil && n == 1
	}, 30*time.Second, 50*time.Millisecond, "the gateway records the tunnel's close")
	rows, err := s.db.Pool.Query(ctx, `SELECT method, actor, role, target_id, outcome, detail->>'caller', detail->>'target',
	        coalesce(detail->>'bytes_to_node', ''), coalesce(detail->>'bytes_from_node', '')
	   FROM audit_events WHERE method LIKE 'relay.%' ORDER BY id`)
	require.NoError(t, err)
	var got []string
	for rows.Next() {
		var method, actor, role, target, outcome, who, what, to, from string
		require.NoError(t, rows.Scan(&method, &actor, &role, &target, &outcome, &who, &what, &to, &from))
		got = append(got, strings.Join([]string{method, actor, role, target, outcome, who, what, to, from}, " "))
	}
	require.NoError(t, rows.Err())
	var actor string // the api's caller, as the api's own row names it
	require.NoError(t, s.db.Pool.QueryRow(ctx, `SELECT actor FROM audit_events WHERE method = 'tunnel.open' AND outcome = 'ok' LIMIT 1`).Scan(&actor))
	port := fmt.Sprintf("port:%d", s.echoPort)
	require.Equal(t, []string{
		strings.Join([]string{"relay.open", actor, "relay", s.node, "ok", caller, port, "", ""}, " "),
		strings.Join([]string{"relay.close", actor, "relay", s.node, "ok", caller, port, "65536", "65536"}, " "),
	}, got)
}

// TestTunnelRelayTokenRotation: the relay's shared token is re-read on
// change by the gateway and the api: once the file holds a new token the
// old one is refused by the relay, and tunnels through the api work with
// the new one, with neither process restarted.
func TestTunnelRelayTokenRotation(t *testing.T) {
	t.Parallel()
	tokenFile := filepath.Join(t.TempDir(), "relay-token")
	const oldToken, newToken = "relay-token-before-rotation-0123", "relay-token-after-rotation-45678"
	require.NoError(t, os.WriteFile(tokenFile, []byte(oldToken+"\n"), 0o600))
	s := startRelayStack(t, "rrot", []string{"--gateway.relay-token-file", tokenFile}, []string{"--api.relay-token-file", tokenFile})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s.echoes(ctx, t)

	// The relay answers a call with the token in force with something
	// other than UNAUTHENTICATED (the fake node id may not exist).
	url := "http://" + s.relayAddr
	require.NotEqual(t, connect.CodeUnauthenticated, connect.CodeOf(s.relayCall(ctx, h2cClient(), url, oldToken)))

	tmp := tokenFile + ".new"
	require.NoError(t, os.WriteFile(tmp, []byte(newToken+"\n"), 0o600))
	require.NoError(t, os.Rename(tmp, tokenFile))
	require.Eventually(t, func() bool {
		return connect.CodeOf(s.relayCall(ctx, h2cClient(), url, oldToken)) == connect.CodeUnauthenticated
	}, time.Minute, 50*time.Millisecond, "the gateway re-reads the token: the old one is refused")
	require.NotEqual(t, connect.CodeUnauthenticated, connect.CodeOf(s.relayCall(ctx, h2cClient(), url, newToken)))
	// The api re-reads it too: until it does its calls are refused
	// UNAUTHENTICATED by the relay.
	s.echoes(ctx, t, connect.CodeUnauthenticated)
}
