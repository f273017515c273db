package reconcile_test

import (
	"context"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

// TestPeriodicSingletonNeitherSkipsNorRepeatsAcrossTakeover: two runtimes
// register the same periodic job; the holder is stopped mid-way and the
// other continues at the next period.
func TestPeriodicSingletonNeitherSkipsNorRepeatsAcrossTakeover(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	exec(t, db.Pool, "CREATE TABLE periods (period bigint, owner text)")
	reg := func(owner string) func(rt *reconcile.Runtime) {
		return func(rt *reconcile.Runtime) {
			require.NoError(t, rt.RegisterPeriodic("sweeper", 100*time.Millisecond, func(ctx context.Context, tx pgx.Tx, period int64) error {
				_, err := tx.Exec(ctx, "INSERT INTO periods VALUES ($1, $2)", period, owner)
				return err
			}))
		}
	}
	a := newRuntime(t, db, "wa", reg("wa"))
	b := newRuntime(t, db, "wb", reg("wb"))
	require.Eventually(t, func() bool { return count(t, db.Pool, "SELECT count(*) FROM periods") >= 5 }, 10*time.Second, 20*time.Millisecond)
	// Stop whichever runtime holds the job's lease now (on a slow machine,
	// e.g. under -race, it may already have moved once: that is a takeover
	// too, and the periods must stay consecutive across it as well).
	var owner string
	require.NoError(t, db.Pool.QueryRow(context.Background(), "SELECT coalesce(owner, '') FROM leases WHERE name = 'singleton:sweeper'").Scan(&owner))
	holder, survivor := a, "wb"
	if owner == "wb" {
		holder, survivor = b, "wa"
	}
	require.NoError(t, services.StopAndAwaitTerminated(context.Background(), holder))
	before := count(t, db.Pool, "SELECT count(*) FROM periods WHERE owner = $1", survivor)
	// A few periods past the takeover, so a skip or repeat there would show.
	require.Eventually(t, func() bool {
		return count(t, db.Pool, "SELECT count(*) FROM periods WHERE owner = $1", survivor) >= before+3
	}, 10*time.Second, 20*time.Millisecond)

	rows, err := db.Pool.Query(context.Background(), "SELECT period FROM periods ORDER BY period")
	require.NoError(t, err)
	periods, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	for i := 1; i < len(periods); i++ {
		require.Equal(t, periods[i-1]+1, periods[i], "periods are consecutive: no skip, no repeat (%v)", periods)
	}
}
