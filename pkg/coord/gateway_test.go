package coord_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestGatewayLeaseLive: the expression is true while the gateway holds its
// lease, false once it released it, for a gateway that never took one and
// for a NULL id; GatewayLeaseLiveAt only at the epoch the lease is held at.
func TestGatewayLeaseLive(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	live := func(id *string) bool {
		t.Helper()
		var b bool
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT `+coord.GatewayLeaseLive("$1::text"), id).Scan(&b))
		return b
	}
	gw := "gw-live"
	c, err := coord.NewClient(db.Pool, gw)
	require.NoError(t, err)
	require.Equal(t, "gateway:gw-live", coord.GatewayLease(gw))
	require.False(t, live(&gw), "never taken")
	l, ok, err := c.Acquire(ctx, coord.GatewayLease(gw), time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	require.True(t, live(&gw))
	liveAt := func(epoch int64) bool {
		t.Helper()
		var b bool
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT `+coord.GatewayLeaseLiveAt("$1::text", "$2::bigint"), gw, epoch).Scan(&b))
		return b
	}
	require.True(t, liveAt(l.Epoch), "at the epoch it holds")
	require.False(t, liveAt(l.Epoch-1), "at an earlier holder's epoch")
	other := "gw-other"
	require.False(t, live(&other))
	require.False(t, live(nil), "a NULL id (no session) is no live gateway")
	_, err = c.Release(ctx, coord.GatewayLease(gw))
	require.NoError(t, err)
	require.False(t, live(&gw), "released")
}
