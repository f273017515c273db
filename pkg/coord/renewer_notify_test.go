package coord_test

import (
	"context"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestStopHandsOverWellUnderARenewalPeriod(t *testing.T) {
	t.Parallel()
	if !pgtest.NotifyAvailable() {
		t.Skip("no LISTEN in this pgtest mode: TestPollingFallbackHandsOverWithinOnePeriod covers the handover")
	}
	db := pgtest.NewDB(t)
	a := startRenewer(t, db, "wa", true, []coord.Group{coord.Controllers}, "singleton:sweeper")
	b := startRenewer(t, db, "wb", true, []coord.Group{coord.Controllers}, "singleton:sweeper")
	require.Eventually(t, settled([]string{"wa", "wb"}, a, b), 15*time.Second, 20*time.Millisecond)
	// Let b hold the singleton so the handover covers it too.
	require.Eventually(t, func() bool {
		_, ok := a.Lease("singleton:sweeper")
		_, okb := b.Lease("singleton:sweeper")
		return ok || okb
	}, 5*time.Second, 10*time.Millisecond)

	start := time.Now()
	require.NoError(t, services.StopAndAwaitTerminated(context.Background(), b))
	require.Eventually(t, func() bool {
		_, ok := a.Lease("singleton:sweeper")
		return ok && len(a.Shards(coord.Controllers)) == coord.NumShards
	}, 5*time.Second, 5*time.Millisecond)
	took := time.Since(start)
	t.Logf("graceful handover (NOTIFY): survivor held all 256 shards and the singleton %s after stop began", took)
	require.Less(t, took, fastTimings.Renew/2, "handover through NOTIFY is well under one renewal period")
	var rows int
	require.NoError(t, db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM workers WHERE id = 'wb'").Scan(&rows))
	require.Zero(t, rows, "the stopped member left the workers table")
	require.Equal(t, "listen", a.NotifyMode())
}

// TestPollingFallbackHandsOverWithinOnePeriod: without LISTEN the survivor
// takes over at its next periodic pass.
func TestPollingFallbackHandsOverWithinOnePeriod(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	a := startRenewer(t, db, "wa", false, []coord.Group{coord.Controllers})
	b := startRenewer(t, db, "wb", false, []coord.Group{coord.Controllers})
	require.Eventually(t, settled([]string{"wa", "wb"}, a, b), 15*time.Second, 20*time.Millisecond)
	start := time.Now()
	require.NoError(t, services.StopAndAwaitTerminated(context.Background(), b))
	require.Eventually(t, func() bool { return len(a.Shards(coord.Controllers)) == coord.NumShards }, 5*time.Second, 5*time.Millisecond)
	took := time.Since(start)
	t.Logf("graceful handover (polling): %s", took)
	require.Less(t, took, fastTimings.Renew+fastTimings.Tick()+500*time.Millisecond)
	require.Equal(t, "polling", a.NotifyMode())
}
