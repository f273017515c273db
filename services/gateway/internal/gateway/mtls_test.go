package gateway

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"flag"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/daemon"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/lifecycle"
	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/tlstest"
)

// mtlsConfig is testConfig serving TLS with a server certificate from ca
// and requiring client certificates ca signed.
func mtlsConfig(t testing.TB, ca *tlstest.CA) Config {
	t.Helper()
	c := testConfig()
	c.TLSCert, c.TLSKey = tlstest.WriteKeyPair(t, ca.Server(t))
	c.TLSClientCA = ca.WriteCA(t)
	return c
}

// clientTLS trusts ca and presents cert.
func clientTLS(ca *tlstest.CA, cert tls.Certificate) *tls.Config {
	return &tls.Config{RootCAs: ca.Pool(), Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
}

// dialMTLS opens a bare stream over TLS presenting cert, on a fresh
// HTTP/2-only connection (no HTTP/1.1 fallback).
func dialMTLS(t testing.TB, addr string, ca *tlstest.CA, cert tls.Certificate) *rawSession {
	t.Helper()
	p := new(http.Protocols)
	p.SetHTTP2(true)
	hc := &http.Client{Transport: &http.Transport{
		Protocols: p, TLSClientConfig: clientTLS(ca, cert),
		DialContext: (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
	}}
	return dialWith(t, hc, "https://"+addr)
}

// refusedHello says Hello and returns the error that ends the stream.
func (s *rawSession) refusedHello(t testing.TB, nodeID, cred string) error {
	t.Helper()
	require.NoError(t, s.hello(nodeID, cred))
	m, err := s.recv(t, 10*time.Second)
	require.Error(t, err, "want the stream refused, got %v", m)
	return err
}

// TestMTLSHelloBoundToClientCertificate: with mTLS, a node holding a valid
// certificate for n-1 cannot say Hello as n-2, even with n-2's credential;
// the refusal writes nothing and takes no admission token. A certificate
// naming n-1 by URI SAN (through pkg/daemon) or by CommonName is welcomed.
func TestMTLSHelloBoundToClientCertificate(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ca := tlstest.NewCA(t)
	cfg := mtlsConfig(t, ca)
	// Exactly one handshake token per Welcome below, never refilled: a
	// refused Hello that took a token would turn a later Welcome into a
	// pushback.
	cfg.HelloRate, cfg.HelloBurst = 1e-6, 2
	g := startGateway(t, db, cfg)
	creds := registerNodes(t, db, "n", 3) // n-0, n-1, n-2
	certN1 := ca.Client(t, "", nodeauth.NodeURI("n-1"))

	before := fingerprint(t, db)
	for _, c := range []struct {
		name       string
		cert       tls.Certificate
		node, cred string
		want       string
	}{
		{"n-1's certificate, Hello as n-2 with n-2's credential", certN1, "n-2", creds[2],
			`hello.node_id "n-2" is not the node named by the client certificate ("n-1")`},
		{"the URI SAN wins over the CommonName", ca.Client(t, "n-2", nodeauth.NodeURI("n-1")), "n-2", creds[2],
			`hello.node_id "n-2" is not the node named by the client certificate ("n-1")`},
		{"the CommonName fallback binds too", ca.Client(t, "n-0"), "n-2", creds[2],
			`hello.node_id "n-2" is not the node named by the client certificate ("n-0")`},
		{"two node URIs", ca.Client(t, "", nodeauth.NodeURI("n-1"), nodeauth.NodeURI("n-2")), "n-1", creds[1],
			`client certificate names more than one node`},
		{"no node named", ca.Client(t, "", "spiffe://example.org/n-1"), "n-1", creds[1],
			`client certificate names no node`},
	} {
		err := dialMTLS(t, g.Addr(), ca, c.cert).refusedHello(t, c.node, c.cred)
		require.Equal(t, connect.CodePermissionDenied, connect.CodeOf(err), "%s: %v", c.name, err)
		require.ErrorContains(t, err, c.want, c.name)
	}
	require.Equal(t, before, fingerprint(t, db), "a refused Hello writes nothing")
	var sessions int
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM node_sessions`).Scan(&sessions))
	require.Zero(t, sessions)
	require.InDelta(t, 5, testutil.ToFloat64(g.m.hellos.WithLabelValues("refused")), 0)

	// Matching URI SAN: pkg/daemon over https is welcomed.
	welcomed := make(chan *nodev1.Welcome, 1)
	d, err := daemon.New(daemon.Config{
		Address: "https://" + g.Addr(), NodeID: "n-1", Credential: creds[1], TLS: clientTLS(ca, certN1),
		Handler: noopHandler, OnWelcome: func(w *nodev1.Welcome) { welcomed <- w },
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = d.Run(ctx) }()
	defer func() { cancel(); wg.Wait() }()
	select {
	case w := <-welcomed:
		require.Equal(t, g.ID(), w.GetGatewayId())
	case <-time.After(15 * time.Second):
		t.Fatalf("daemon with n-1's certificate not welcomed: %+v", d.Stats())
	}
	var gw, state string
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		`SELECT gateway_id, state FROM node_sessions WHERE node_id = 'n-1'`).Scan(&gw, &state))
	require.Equal(t, [2]string{g.ID(), "connected"}, [2]string{gw, state})

	// CommonName fallback: a certificate with no leasehold URI names its CN.
	dialMTLS(t, g.Addr(), ca, ca.Client(t, "n-0", "spiffe://example.org/host")).welcome(t, "n-0", creds[0])

	require.InDelta(t, 2, testutil.ToFloat64(g.m.hellos.WithLabelValues("welcomed")), 0)
	require.InDelta(t, 0, testutil.ToFloat64(g.m.hellos.WithLabelValues("pushback")), 0,
		"refused Hellos took no admission token")
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM node_sessions WHERE node_id = 'n-2'`).Scan(&sessions))
	require.Zero(t, sessions, "n-2 never said Hello")
}

// TestMTLSBindingOff: with --gateway.tls-bind-node-id=false the certificate
// is only the transport's (host certificates); the credential still decides.
func TestMTLSBindingOff(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ca := tlstest.NewCA(t)
	cfg := mtlsConfig(t, ca)
	cfg.TLSBindNodeID = false
	g := startGateway(t, db, cfg)
	creds := registerNodes(t, db, "n", 3)
	certN1 := ca.Client(t, "", nodeauth.NodeURI("n-1"))

	before := fingerprint(t, db)
	err := dialMTLS(t, g.Addr(), ca, certN1).refusedHello(t, "n-2", creds[1])
	require.Equal(t, connect.CodeUnauthenticated, connect.CodeOf(err), "the credential is still required: %v", err)
	require.Equal(t, before, fingerprint(t, db))

	w := dialMTLS(t, g.Addr(), ca, certN1).welcome(t, "n-2", creds[2])
	require.Equal(t, g.ID(), w.GetGatewayId())
	dialMTLS(t, g.Addr(), ca, ca.Client(t, "web-01.example.com")).welcome(t, "n-0", creds[0])
}

// TestCertNodeErrorFailsClosed: with binding on, a connection without a
// verified chain (which RequireAndVerifyClientCert should make impossible)
// is refused rather than let through.
func TestCertNodeErrorFailsClosed(t *testing.T) {
	t.Parallel()
	for _, cs := range []*tls.ConnectionState{nil, {}, {VerifiedChains: [][]*x509.Certificate{{}}}} {
		err := certNodeError(cs, "n-1")
		require.Equal(t, connect.CodePermissionDenied, connect.CodeOf(err))
		require.ErrorContains(t, err, "no verified client certificate")
	}
}

// TestBindNodeIDFlag: on by default, off by flag or LEASEHOLD_* environment.
func TestBindNodeIDFlag(t *testing.T) {
	require.True(t, Defaults().TLSBindNodeID)
	parse := func(args ...string) Config {
		var c Config
		fs := flag.NewFlagSet("gateway", flag.ContinueOnError)
		c.RegisterFlags("", fs)
		require.NoError(t, fs.Parse(args))
		require.NoError(t, lifecycle.ApplyEnv(fs))
		return c
	}
	require.False(t, parse("--gateway.tls-bind-node-id=false").TLSBindNodeID)
	t.Setenv(lifecycle.EnvName("gateway.tls-bind-node-id"), "false")
	require.Equal(t, "LEASEHOLD_GATEWAY_TLS_BIND_NODE_ID", lifecycle.EnvName("gateway.tls-bind-node-id"))
	require.False(t, parse().TLSBindNodeID)
}
