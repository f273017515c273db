package gateway

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/grafana/dskit/services"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1/nodev1connect"
	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestMain(m *testing.M) {
	if clientMain() {
		return
	}
	pgtest.Main(m)
}

// testConfig is a gateway configuration with short timings for tests.
func testConfig() Config {
	c := Defaults()
	c.ListenAddr = "127.0.0.1:0"
	c.LeaseTTL, c.LeaseRenew = 4*time.Second, 500*time.Millisecond
	c.SessionLease = 10 * time.Second
	c.LivenessInterval = 200 * time.Millisecond
	c.HeartbeatInterval = time.Second
	c.DispatchPoll = 200 * time.Millisecond
	c.DrainMaxDelay, c.DrainGrace = 0, 200*time.Millisecond
	// LEASEHOLD_GATEWAY_HTTP2_SERVER=std runs the suite on net/http's server.
	if v := os.Getenv(envHTTP2Server); v != "" {
		c.HTTP2Server = v
	}
	return c
}

// envHTTP2Server picks the gateways' HTTP/2 server in tests (the
// --gateway.http2-server flag's environment fallback).
const envHTTP2Server = "LEASEHOLD_GATEWAY_HTTP2_SERVER"

// gwSeq numbers the gateways of parallel tests (go test -race found the
// plain int's increments racing).
var gwSeq atomic.Int64

func startGateway(t testing.TB, db *pgtest.DB, cfg Config) *Gateway {
	t.Helper()
	g, err := New(cfg, Deps{ID: fmt.Sprintf("gw_test%d", gwSeq.Add(1)), DB: db.Pool, NotifyURL: db.DirectURL, Registry: prometheus.NewRegistry()})
	require.NoError(t, err)
	require.NoError(t, services.StartAndAwaitRunning(context.Background(), g))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = services.StopAndAwaitTerminated(ctx, g)
	})
	return g
}

// registerNodes registers n nodes node-0..node-<n-1> in one statement and
// returns their credentials.
func registerNodes(t testing.TB, db *pgtest.DB, prefix string, n int) []string {
	t.Helper()
	ids := make([]string, n)
	creds := make([]string, n)
	hashes := make([][]byte, n)
	for i := range n {
		c, err := nodeauth.NewCredential()
		require.NoError(t, err)
		ids[i], creds[i] = fmt.Sprintf("%s-%d", prefix, i), c
		h := sha256.Sum256([]byte(c))
		hashes[i] = h[:]
	}
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `INSERT INTO nodes (id) SELECT unnest($1::text[])`, ids)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `INSERT INTO node_credentials (node_id, credential_hash) SELECT * FROM unnest($1::text[], $2::bytea[])`, ids, hashes)
	require.NoError(t, err)
	return creds
}

// oneNodeSession starts a gateway with cfg on a fresh database, registers
// one node (n-0) and returns a raw session that node has opened and been
// welcomed on.
func oneNodeSession(t testing.TB, cfg Config) (*pgtest.DB, *Gateway, *rawSession) {
	t.Helper()
	db := pgtest.NewDB(t)
	g := startGateway(t, db, cfg)
	creds := registerNodes(t, db, "n", 1)
	s := dialRaw(t, g.Addr())
	s.welcome(t, "n-0", creds[0])
	return db, g, s
}

func h2cClient() *http.Client {
	p := new(http.Protocols)
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{Protocols: p, DialContext: (&net.Dialer{Timeout: 5 * time.Second}).DialContext}}
}

// rawSession is a bare client stream for tests that speak the protocol by hand.
type rawSession struct {
	stream *connect.BidiStreamForClient[nodev1.ConnectRequest, nodev1.ConnectResponse]
	cancel context.CancelFunc
}

func dialRaw(t testing.TB, addr string) *rawSession {
	t.Helper()
	return dialWith(t, h2cClient(), "http://"+addr)
}

// dialWith opens a bare client stream to baseURL through hc, whose idle
// connections are closed at cleanup.
func dialWith(t testing.TB, hc *http.Client, baseURL string) *rawSession {
	t.Helper()
	client := nodev1connect.NewNodeGatewayServiceClient(hc, baseURL)
	ctx, cancel := context.WithCancel(context.Background())
	s := &rawSession{stream: client.Connect(ctx), cancel: cancel}
	t.Cleanup(func() {
		cancel()
		_ = s.stream.CloseRequest()
		_ = s.stream.CloseResponse()
		hc.CloseIdleConnections()
	})
	return s
}

// hello sends a Hello. A gateway that is not serving answers (a Pushback) and closes the
// stream before it reads the Hello; the Send then returns io.EOF, which
// connect-go documents as "the outcome is in Receive". hello returns nil
// then, and the next recv reads the answer.
func (s *rawSession) hello(nodeID, cred string, inFlight ...string) error {
	err := s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Hello{Hello: &nodev1.Hello{
		NodeId: nodeID, Credential: cred, Kind: nodev1.NodeKind_NODE_KIND_NODE, InFlightCommandIds: inFlight,
	}}})
	if errors.Is(err, io.EOF) {
		return nil
	}
	return err
}

// recv reads one message with a timeout.
func (s *rawSession) recv(t testing.TB, timeout time.Duration) (*nodev1.ConnectResponse, error) {
	t.Helper()
	type res struct {
		m   *nodev1.ConnectResponse
		err error
	}
	ch := make(chan res, 1)
	go func() {
		m, err := s.stream.Receive()
		ch <- res{m, err}
	}()
	select {
	case r := <-ch:
		return r.m, r.err
	case <-time.After(timeout):
		s.cancel()
		select {
		case r := <-ch:
			t.Fatalf("no message within %s (then: %v)", timeout, r.err)
		case <-time.After(5 * time.Second):
			t.Fatalf("no message within %s, and the Receive did not end on cancel either", timeout)
		}
		return nil, nil
	}
}

// welcome says Hello and requires a Welcome.
func (s *rawSession) welcome(t testing.TB, nodeID, cred string) *nodev1.Welcome {
	t.Helper()
	require.NoError(t, s.hello(nodeID, cred))
	m, err := s.recv(t, 10*time.Second)
	require.NoError(t, err)
	require.NotNil(t, m.GetWelcome(), "want Welcome, got %v", m)
	return m.GetWelcome()
}

// recvUntilErr reads until the stream fails and returns the Connect code.
func (s *rawSession) recvUntilErr(t testing.TB, timeout time.Duration) connect.Code {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		_, err := s.recv(t, time.Until(deadline)+time.Second)
		if err != nil {
			return connect.CodeOf(err)
		}
	}
	t.Fatalf("stream still open after %s", timeout)
	return 0
}

// fingerprint summarises every row the gateway may write.
func fingerprint(t testing.TB, db *pgtest.DB) string {
	t.Helper()
	var s string
	err := db.Pool.QueryRow(context.Background(), `
SELECT concat_ws(' | ',
  (SELECT string_agg(node_id || ':' || gateway_id || ':' || session_epoch || ':' || state || ':' || last_seen_at, ',' ORDER BY node_id) FROM node_sessions),
  (SELECT string_agg(id || ':' || state || ':' || state_epoch, ',' ORDER BY id) FROM nodes),
  (SELECT string_agg(id || ':' || state || ':' || dispatch_count, ',' ORDER BY id) FROM commands),
  (SELECT count(*) FROM command_results_all)::text,
  (SELECT count(*) FROM node_events)::text)`).Scan(&s)
	require.NoError(t, err)
	return s
}

func insertCommand(t testing.TB, db *pgtest.DB, nodeID, kind string) string {
	t.Helper()
	var id string
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		`INSERT INTO commands (node_id, kind, payload) VALUES ($1, $2, 'x') RETURNING id`, nodeID, kind).Scan(&id))
	return id
}

// factsFingerprint summarises commands, results, events and the other node.
func factsFingerprint(t testing.TB, db *pgtest.DB) string {
	t.Helper()
	var s string
	err := db.Pool.QueryRow(context.Background(), `
SELECT concat_ws(' | ',
  (SELECT string_agg(id || ':' || state || ':' || state_epoch, ',' ORDER BY id) FROM nodes WHERE id <> 'n-0'),
  (SELECT string_agg(node_id || ':' || session_epoch, ',' ORDER BY node_id) FROM node_sessions),
  (SELECT string_agg(id || ':' || state || ':' || dispatch_count, ',' ORDER BY id) FROM commands),
  (SELECT count(*) FROM command_results_all)::text,
  (SELECT count(*) FROM node_events)::text)`).Scan(&s)
	require.NoError(t, err)
	return s
}
