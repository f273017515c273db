package gateway

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestHelloSlotsLeaveHalfThePool: Hello transactions never take more than
// half the gateway's connections, so the group commit, dispatch and the
// liveness write keep theirs through a reconnect wave; a smaller
// --gateway.max-pending-hellos still wins, and a tiny pool still admits one.
func TestHelloSlotsLeaveHalfThePool(t *testing.T) {
	for _, c := range []struct {
		maxPending int
		pool       int32
		want       int64
	}{
		{64, 10, 5}, {64, 100, 50}, {4, 100, 4}, {64, 1, 1}, {1, 10, 1},
	} {
		require.Equal(t, c.want, helloSlotsFor(c.maxPending, c.pool), "max-pending-hellos %d, pool %d", c.maxPending, c.pool)
	}
}
