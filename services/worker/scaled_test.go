package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/clock"
	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

// TestScaledClockTakeoverWithProductionDurations runs two workers with the
// production lease durations (TTL 15 s, renew 5 s) on a clock scaled 10x,
// the database's compute_now() scaled alike: a SIGKILLed holder's leases
// move within about TTL/10 of wall time, and a worker started against an
// unscaled database refuses to run.
func TestScaledClockTakeoverWithProductionDurations(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	db := pgtest.NewDB(t)
	ctx := context.Background()
	bin := proctest.Build(t, ".")
	s := clock.Scale{Epoch: time.Now().Add(-2 * time.Second), Rate: 10}
	scaleArgs := []string{"--clock.rate", "10", "--clock.epoch", s.Epoch.Format(time.RFC3339Nano), "--log-format", "text"}
	start := func(id string, wantReady bool) *proctest.Proc {
		port, err := pglocal.FreePort()
		require.NoError(t, err)
		p := proctest.Start(t, id, bin, nil, append([]string{"--id", id, "--database-url", db.URL,
			"--http-addr", fmt.Sprintf("127.0.0.1:%d", port)}, append(scaleArgs, pgtest.PoolerFlags(db.URL)...)...)...)
		if wantReady {
			p.WaitReady(20 * time.Second)
		}
		return p
	}

	refused := start("w-unscaled", false)
	require.Equal(t, 1, refused.Wait(20*time.Second), "a scaled worker on an unscaled database exits 1")
	require.Contains(t, refused.Logs(), "compute_now()")

	require.NoError(t, clock.InstallSQL(ctx, db.Pool, s))
	wa := start("wa", true)
	heldBy := func(owner string) int {
		var n int
		require.NoError(t, db.Pool.QueryRow(ctx,
			"SELECT count(*) FROM leases WHERE owner = $1 AND name LIKE 'shard:%' AND expires_at > compute_now()", owner).Scan(&n))
		return n
	}
	require.Eventually(t, func() bool { return heldBy("wa") == 256 }, 20*time.Second, 20*time.Millisecond)
	start("wb", true)
	require.Eventually(t, func() bool { return heldBy("wa") > 0 && heldBy("wb") > 0 && heldBy("wa")+heldBy("wb") == 256 },
		20*time.Second, 20*time.Millisecond, "the two workers split the shards")

	wa.Kill()
	killed := time.Now()
	require.Eventually(t, func() bool { return heldBy("wb") == 256 }, 10*time.Second, 10*time.Millisecond)
	took := time.Since(killed)
	t.Logf("takeover after SIGKILL: %s wall = %s simulated (TTL 15 s simulated)", took.Round(time.Millisecond), (took * 10).Round(time.Millisecond))
	// Bound: TTL + the survivor's 1 s tick + slack, in simulated time.
	require.Less(t, took, 2500*time.Millisecond, "15 s of lease at 10x is 1.5 s of wall time")
}
