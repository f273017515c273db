package gateway

import (
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

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
