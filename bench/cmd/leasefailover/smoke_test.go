package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/bench/internal/harness"
)

// TestLeaseFailoverSmoke runs the lease failover bench briefly: one run of
// the crash (SIGKILL, liveness session) and the SIGTERM scenarios against
// leasehold workers, then the coordination load of one idle member over a
// 2 s window. River's side is left out: its crash run waits out River's
// 15 s leader TTL, longer than the rest together. In each run the survivor
// must take over every lease the victim held, the SIGTERMed worker must exit
// 0, and the load must count the member's statements and the shard leases
// it holds.
func TestLeaseFailoverSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	t.Setenv("LEASEHOLD_DATABASE_URL", "") // a throwaway local cluster
	c := config{runs: 1, scenarios: []string{"crash", "sigterm"}, river: false, members: []int{1},
		loadLiveness: []bool{true}, loadSettle: time.Second, loadWindow: 2 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	b := &bench{c: c, sup: &harness.Supervisor{}}
	defer b.sup.Stop()
	res, err := b.run(ctx)
	require.NoError(t, err)
	for _, s := range c.scenarios {
		lh := res.Leasehold[s]
		require.NotNil(t, lh, s)
		require.Equal(t, 1, lh.Dist.N, s)
		require.Len(t, lh.LeasesMoved, 1, s)
		require.Positive(t, lh.LeasesMoved[0], "%s: the victim held leases to take over", s)
		require.Zero(t, lh.BadExits, s)
	}
	require.Len(t, res.Load, 1)
	l := res.Load[0]
	require.Equal(t, 1, l.Members)
	require.True(t, l.Liveness)
	require.Positive(t, l.Statements)
	require.Positive(t, l.ShardsHeld)
	require.Empty(t, res.River)
	t.Logf("takeover: crash %.2f s, sigterm %.2f s", res.Leasehold["crash"].Dist.Max, res.Leasehold["sigterm"].Dist.Max)
}
