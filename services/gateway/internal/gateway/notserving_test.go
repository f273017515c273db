package gateway

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestFencedGatewayPushesHellosBack: a fenced gateway (its lease lost, as
// in a database outage) answers a Hello with a Pushback whose retry_after
// is one to three seconds, so the node comes back when the gateway serves
// again instead of after a back-off grown by the outage.
func TestFencedGatewayPushesHellosBack(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	creds := registerNodes(t, db, "fenced", 1)
	g := startGateway(t, db, testConfig())
	g.fence("test: the lease is gone")
	require.True(t, g.Fenced())

	s := dialRaw(t, g.Addr())
	require.NoError(t, s.hello("fenced-0", creds[0]))
	m, err := s.recv(t, 10*time.Second)
	require.NoError(t, err)
	pb := m.GetPushback()
	require.NotNil(t, pb, "a fenced gateway pushes the Hello back, got %v", m)
	require.Equal(t, "not-serving", pb.GetReason())
	retry := pb.GetRetryAfter().AsDuration()
	require.GreaterOrEqual(t, retry, time.Second)
	require.Less(t, retry, 3*time.Second)
	_, err = s.recv(t, 10*time.Second)
	require.Equal(t, connect.CodeUnavailable, connect.CodeOf(err))
	require.Equal(t, 1.0, testutil.ToFloat64(g.m.pushbacks.WithLabelValues("not-serving")))
}

// TestHelloRefusesWhatItCannotStore: a Hello with a kind no gateway knows,
// or with a NUL byte in a label, site or version (PostgreSQL text and
// jsonb refuse NUL), is INVALID_ARGUMENT, a permanent refusal, not the
// retryable UNAVAILABLE a failed write would give.
func TestHelloRefusesWhatItCannotStore(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	creds := registerNodes(t, db, "badhello", 1)
	g := startGateway(t, db, testConfig())
	for name, h := range map[string]*nodev1.Hello{
		"unknown kind":   {NodeId: "badhello-0", Credential: creds[0], Kind: nodev1.NodeKind(99)},
		"NUL in label":   {NodeId: "badhello-0", Credential: creds[0], Kind: nodev1.NodeKind_NODE_KIND_NODE, Labels: map[string]string{"rack": "a\x00b"}},
		"NUL in site":    {NodeId: "badhello-0", Credential: creds[0], Kind: nodev1.NodeKind_NODE_KIND_NODE, SiteId: "s\x00"},
		"NUL in version": {NodeId: "badhello-0", Credential: creds[0], Kind: nodev1.NodeKind_NODE_KIND_NODE, DaemonVersion: "v\x00"},
	} {
		s := dialRaw(t, g.Addr())
		require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Hello{Hello: h}}), name)
		_, err := s.recv(t, 10*time.Second)
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%s: %v", name, err)
		require.ErrorContains(t, err, "hello.", name)
	}
	var sessions int
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM node_sessions`).Scan(&sessions))
	require.Zero(t, sessions, "no refused Hello opened a session")
}
