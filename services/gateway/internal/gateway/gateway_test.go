package gateway

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1/nodev1connect"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestConfigRefusesBadOrderings(t *testing.T) {
	t.Parallel()
	c := Defaults()
	require.NoError(t, c.Validate())
	c.LeaseRenew = 10 * time.Second
	err := c.Validate()
	require.ErrorContains(t, err, "--gateway.lease-renew 10s must be less than half of --gateway.lease-ttl 20s")
	c = Defaults()
	c.SessionLease = 15 * time.Second
	require.ErrorContains(t, c.Validate(), "--gateway.session-lease 15s must be greater than --gateway.lease-ttl 20s")
	c = Defaults()
	require.Equal(t, HTTP2Lean, c.HTTP2Server)
	c.HTTP2Server = "fast"
	require.ErrorContains(t, c.Validate(), `--gateway.http2-server "fast" must be "lean" or "std"`)

	// Tunnels: the relay needs its token; per-node fits in per-gateway.
	c = Defaults()
	require.Empty(t, c.RelayListenAddr, "no relay unless asked for")
	c.RelayListenAddr = "127.0.0.1:0"
	require.ErrorContains(t, c.Validate(), `--gateway.relay-listen-addr "127.0.0.1:0" needs --gateway.relay-token-file or --gateway.relay-tls.client-ca-file`)
	c.RelayTLS.ClientCA = "/ca.pem"
	require.ErrorContains(t, c.Validate(), "--gateway.relay-tls.client-ca-file needs --gateway.relay-tls.cert-file", "client certificates need a handshake")
	c.RelayTLS.Cert = "/relay.pem"
	require.ErrorContains(t, c.Validate(), "--gateway.relay-tls.cert-file and --gateway.relay-tls.key-file go together")
	c.RelayTLS.Key = "/relay-key.pem"
	require.NoError(t, c.Validate(), "mTLS alone authenticates the api")
	c.RelayClientName = ""
	require.ErrorContains(t, c.Validate(), "--gateway.relay-tls.client-name must not be empty")
	c = Defaults()
	c.MaxTunnelsPerNode, c.MaxTunnels = 8, 4
	require.ErrorContains(t, c.Validate(), "--gateway.max-tunnels-per-node 8 must be at least 1 and at most --gateway.max-tunnels 4")
	c = Defaults()
	c.MaxTunnelsPerNode = 16
	require.ErrorContains(t, c.Validate(), "--gateway.max-tunnels-per-node 16 must be at most 15")
	c = Defaults()
	c.TunnelIdleTimeout = 0
	require.ErrorContains(t, c.Validate(), "--gateway.tunnel-idle-timeout 0s must be at least 1s")
}

// TestSlowNodeQueueOverflowClosesSession: messages queued past maxQueued
// close the session RESOURCE_EXHAUSTED, on either HTTP/2 server (inline
// sends on the lean one, a writer goroutine on net/http's), and the node
// learns why.
func TestSlowNodeQueueOverflowClosesSession(t *testing.T) {
	db := pgtest.NewDB(t)
	g := startGateway(t, db, testConfig())
	creds := registerNodes(t, db, "q", 1)
	s := dialRaw(t, g.Addr())
	s.welcome(t, "q-0", creds[0])
	g.mu.Lock()
	sess := g.sessions["q-0"]
	g.mu.Unlock()
	require.NotNil(t, sess)
	require.True(t, sess.enqueue(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_HeartbeatAck{HeartbeatAck: &nodev1.HeartbeatAck{Sequence: 1}}}))
	m, err := s.recv(t, 5*time.Second)
	require.NoError(t, err)
	require.EqualValues(t, 1, m.GetHeartbeatAck().GetSequence(), "a queued message is sent")
	flood := make([]*nodev1.ConnectResponse, maxQueued+1)
	for i := range flood {
		flood[i] = &nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_HeartbeatAck{HeartbeatAck: &nodev1.HeartbeatAck{}}}
	}
	require.False(t, sess.enqueue(flood...))
	require.Equal(t, connect.CodeResourceExhausted, s.recvUntilErr(t, 5*time.Second))
	require.False(t, sess.enqueue(flood[0]), "no Send after the session closed")
	require.Eventually(t, func() bool { return g.SessionCount() == 0 }, 5*time.Second, 10*time.Millisecond)
}

func TestHelloWelcomeDispatchResult(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	g := startGateway(t, db, testConfig())
	creds := registerNodes(t, db, "n", 1)
	s := dialRaw(t, g.Addr())
	w := s.welcome(t, "n-0", creds[0])
	require.Equal(t, int64(1), w.GetSessionEpoch())
	require.Equal(t, g.ID(), w.GetGatewayId())

	id := insertCommand(t, db, "n-0", "exec")
	m, err := s.recv(t, 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, id, m.GetCommand().GetCommandId())
	require.EqualValues(t, 1, m.GetCommand().GetDispatchCount())

	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandAck{CommandAck: &nodev1.CommandAck{CommandId: id}}}))
	for range 2 { // the same result twice: stored once
		require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandResult{CommandResult: &nodev1.CommandResult{
			CommandId: id, ResultId: "r1", ExitCode: 0, Output: []byte("ok"),
		}}}))
	}
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Heartbeat{Heartbeat: &nodev1.Heartbeat{Sequence: 7}}}))
	m, err = s.recv(t, 5*time.Second)
	require.NoError(t, err)
	require.EqualValues(t, 7, m.GetHeartbeatAck().GetSequence())

	var state string
	var results int
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		`SELECT c.state, (SELECT count(*) FROM command_results_all r WHERE r.command_id = c.id) FROM commands c WHERE id = $1`, id).Scan(&state, &results))
	require.Equal(t, "succeeded", state)
	require.Equal(t, 1, results)
}

// garbageCodec sends bytes that are not a ConnectRequest.
type garbageCodec struct{}

func (garbageCodec) Name() string { return "proto" }
func (garbageCodec) Marshal(any) ([]byte, error) {
	return []byte{0xff, 0xff, 0xff, 0xff, 0x0f, 0x01}, nil
}
func (garbageCodec) Unmarshal(b []byte, v any) error { return proto.Unmarshal(b, v.(proto.Message)) }

func TestBadInputIsRefusedAndWritesNothing(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	cfg := testConfig()
	g := startGateway(t, db, cfg)
	creds := registerNodes(t, db, "n", 2)
	otherCmd := insertCommand(t, db, "n-1", "exec")
	ctx := context.Background()

	check := func(t *testing.T, want connect.Code, run func() connect.Code) {
		before := fingerprint(t, db)
		require.Equal(t, want, run())
		time.Sleep(3 * cfg.LivenessInterval) // a window of three liveness passes for a stray write: what is checked is that none lands
		require.Equal(t, before, fingerprint(t, db), "nothing may be written")
	}
	// Inside a session, the refused message writes nothing; the stream it
	// closes is recorded as disconnected, as any ended stream is.
	checkFacts := func(t *testing.T, want connect.Code, run func() connect.Code) {
		before := factsFingerprint(t, db)
		require.Equal(t, want, run())
		time.Sleep(3 * cfg.LivenessInterval) // the same window: what is checked is that nothing lands in it
		require.Equal(t, before, factsFingerprint(t, db), "the refused message may write nothing")
	}

	t.Run("malformed frame", func(t *testing.T) {
		check(t, connect.CodeInvalidArgument, func() connect.Code {
			hc := h2cClient()
			defer hc.CloseIdleConnections()
			c := connect.NewClient[nodev1.ConnectRequest, nodev1.ConnectResponse](hc,
				"http://"+g.Addr()+nodev1connect.NodeGatewayServiceConnectProcedure, connect.WithCodec(garbageCodec{}))
			st := c.CallBidiStream(ctx)
			_ = st.Send(&nodev1.ConnectRequest{})
			_, err := st.Receive()
			_ = st.CloseRequest()
			_ = st.CloseResponse()
			return connect.CodeOf(err)
		})
	})
	t.Run("oversized message", func(t *testing.T) {
		check(t, connect.CodeResourceExhausted, func() connect.Code {
			s := dialRaw(t, g.Addr())
			require.NoError(t, s.hello("n-0", strings.Repeat("x", 2<<20)))
			_, err := s.recv(t, 5*time.Second)
			require.ErrorContains(t, err, "larger than configured max")
			return connect.CodeOf(err)
		})
	})
	t.Run("first message not Hello", func(t *testing.T) {
		check(t, connect.CodeInvalidArgument, func() connect.Code {
			s := dialRaw(t, g.Addr())
			require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Heartbeat{Heartbeat: &nodev1.Heartbeat{}}}))
			_, err := s.recv(t, 5*time.Second)
			return connect.CodeOf(err)
		})
	})
	t.Run("unknown node", func(t *testing.T) {
		check(t, connect.CodeUnauthenticated, func() connect.Code {
			s := dialRaw(t, g.Addr())
			require.NoError(t, s.hello("nobody", creds[0]))
			_, err := s.recv(t, 5*time.Second)
			return connect.CodeOf(err)
		})
	})
	t.Run("wrong credential", func(t *testing.T) {
		check(t, connect.CodeUnauthenticated, func() connect.Code {
			s := dialRaw(t, g.Addr())
			require.NoError(t, s.hello("n-0", creds[1])) // n-1's credential
			_, err := s.recv(t, 5*time.Second)
			return connect.CodeOf(err)
		})
	})

	// The remaining cases need a welcomed session; its Hello writes, so the
	// fingerprint is taken after Welcome.
	s := dialRaw(t, g.Addr())
	s.welcome(t, "n-0", creds[0])
	t.Run("result for another node's command", func(t *testing.T) {
		checkFacts(t, connect.CodePermissionDenied, func() connect.Code {
			require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandResult{CommandResult: &nodev1.CommandResult{
				CommandId: otherCmd, ResultId: "r-steal", ExitCode: 0,
			}}}))
			return s.recvUntilErr(t, 5*time.Second)
		})
	})
	s2 := dialRaw(t, g.Addr())
	s2.welcome(t, "n-0", creds[0])
	t.Run("second Hello on one stream", func(t *testing.T) {
		checkFacts(t, connect.CodeFailedPrecondition, func() connect.Code {
			require.NoError(t, s2.hello("n-0", creds[0]))
			return s2.recvUntilErr(t, 5*time.Second)
		})
	})
}

func TestZombieSessionClosedWhenNodeSaysHelloElsewhere(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	cfg := testConfig()
	g1 := startGateway(t, db, cfg)
	g2 := startGateway(t, db, cfg)
	creds := registerNodes(t, db, "n", 1)

	old := dialRaw(t, g1.Addr())
	require.EqualValues(t, 1, old.welcome(t, "n-0", creds[0]).GetSessionEpoch())
	cur := dialRaw(t, g2.Addr())
	require.EqualValues(t, 2, cur.welcome(t, "n-0", creds[0]).GetSessionEpoch())

	// g1's next liveness write matches no row: it closes its zombie.
	start := time.Now()
	require.Equal(t, connect.CodeUnavailable, old.recvUntilErr(t, 5*time.Second))
	require.Less(t, time.Since(start), 5*cfg.LivenessInterval+time.Second)
	require.Eventually(t, func() bool { return g1.SessionCount() == 0 }, 5*time.Second, 10*time.Millisecond)

	var gw string
	var epoch int64
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT gateway_id, session_epoch FROM node_sessions WHERE node_id = 'n-0'`).Scan(&gw, &epoch))
	require.Equal(t, g2.ID(), gw, "g1's close must not touch the row g2 holds")
	require.EqualValues(t, 2, epoch)

	// A new command goes to g2 without anything rewritten.
	id := insertCommand(t, db, "n-0", "exec")
	m, err := cur.recv(t, 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, id, m.GetCommand().GetCommandId())
	var by string
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT dispatched_by FROM commands WHERE id = $1`, id).Scan(&by))
	require.Equal(t, g2.ID(), by)
}

// TestStreamWithoutHelloIsClosed: a dial that opens a stream and never says
// Hello is closed DeadlineExceeded after the hello timeout, so idle dials
// cannot hold stream slots; nothing is written.
func TestStreamWithoutHelloIsClosed(t *testing.T) {
	db := pgtest.NewDB(t)
	cfg := testConfig()
	cfg.HelloTimeout = 300 * time.Millisecond
	g := startGateway(t, db, cfg)
	before := fingerprint(t, db)
	s := dialRaw(t, g.Addr())
	require.NoError(t, s.stream.Send(nil)) // headers only: the stream is open, no message
	start := time.Now()
	require.Equal(t, connect.CodeDeadlineExceeded, s.recvUntilErr(t, 5*time.Second))
	require.Less(t, time.Since(start), 3*time.Second)
	require.Equal(t, before, fingerprint(t, db))
	require.Eventually(t, func() bool { return g.streams.Load() == 0 }, 5*time.Second, 10*time.Millisecond, "the slot is freed")
}

// TestPartialHelloIsClosed: a dial that sends part of a Hello and then
// nothing is closed DeadlineExceeded after the hello timeout too (on the
// lean server the handler waits for the body, then Receives: the timeout
// must bound that Receive as well).
func TestPartialHelloIsClosed(t *testing.T) {
	db := pgtest.NewDB(t)
	cfg := testConfig()
	cfg.HelloTimeout = 300 * time.Millisecond
	g := startGateway(t, db, cfg)
	pr, pw := io.Pipe()
	defer pw.Close()
	req, err := http.NewRequest(http.MethodPost, "http://"+g.Addr()+nodev1connect.NodeGatewayServiceConnectProcedure, pr)
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/connect+proto")
	hc := h2cClient()
	defer hc.CloseIdleConnections()
	go func() { _, _ = pw.Write([]byte{0, 0, 0, 0, 100, 0x0a, 0x01}) }() // 2 of 100 bytes
	start := time.Now()
	body := make(chan string, 1)
	go func() {
		res, err := hc.Do(req)
		if err != nil {
			body <- err.Error()
			return
		}
		b, _ := io.ReadAll(res.Body)
		_ = res.Body.Close()
		body <- string(b)
	}()
	select {
	case b := <-body:
		require.Contains(t, b, "deadline_exceeded")
	case <-time.After(5 * time.Second):
		_ = pw.CloseWithError(io.ErrUnexpectedEOF)
		<-body
		t.Fatal("a partial Hello holds the stream past the hello timeout")
	}
	require.Less(t, time.Since(start), 3*time.Second)
	require.Eventually(t, func() bool { return g.streams.Load() == 0 }, 5*time.Second, 10*time.Millisecond, "the slot is freed")
}
