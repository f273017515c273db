package coord_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgha"
)

// TestEpochsStayUniqueAcrossAsyncFailover: with asynchronous replication a
// promoted standby can lack the last grant of a lease. agent-b took the
// boot lease at epoch 2 on the old primary; the standby never received it.
// After the promotion agent-c takes the lease on the new primary: it must
// not be given epoch 2 again (two holders at one epoch for whatever
// remembers epochs outside the database), and agent-b's fence must fail
// there.
func TestEpochsStayUniqueAcrossAsyncFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("a primary and a standby")
	}
	t.Parallel()
	ctx := context.Background()
	pair := pgha.Start(t, pgha.Options{})
	db, err := pgdb.Connect(ctx, pgdb.Config{URL: pair.MultiHostURL(), AppName: "epoch-failover", MaxConns: 4})
	require.NoError(t, err)
	defer db.Close()

	a, ok, err := coord.Take(ctx, db, "site:s1:boot", "agent-a", time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	require.EqualValues(t, 1, a.Epoch)
	_, err = db.Exec(ctx, `UPDATE leases SET expires_at = '-infinity' WHERE name = 'site:s1:boot'`)
	require.NoError(t, err)
	require.NoError(t, pair.WaitReplicated(ctx))

	require.NoError(t, pair.PauseReplication(ctx))
	b, ok, err := coord.Take(ctx, db, "site:s1:boot", "agent-b", time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	require.EqualValues(t, 2, b.Epoch, "granted on the old primary, never replicated")

	require.NoError(t, pair.KillPrimary(ctx))
	require.NoError(t, pair.Promote(ctx))
	tl, err := pair.Timeline(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, tl)

	var floor int64
	require.Eventually(t, func() bool {
		return db.QueryRow(ctx, `SELECT lease_epoch_floor()`).Scan(&floor) == nil
	}, time.Minute, 100*time.Millisecond, "the pool follows the promotion")
	require.Equal(t, int64(1)<<32, floor)
	var owner string
	var epoch int64
	require.NoError(t, db.QueryRow(ctx, `SELECT owner, epoch FROM leases WHERE name = 'site:s1:boot'`).Scan(&owner, &epoch))
	require.Equal(t, "agent-a", owner, "the new primary never saw agent-b's grant")
	require.EqualValues(t, 1, epoch)

	c, ok, err := coord.Take(ctx, db, "site:s1:boot", "agent-c", time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	require.Greater(t, c.Epoch, b.Epoch, "an epoch lost in the failover is never issued to someone else")
	require.Equal(t, floor+1, c.Epoch)

	b.ValidUntil = time.Now().Add(time.Minute)
	err = coord.RunFenced(ctx, db, b, coord.FenceOptions{}, func(context.Context, pgx.Tx) error { return nil })
	require.ErrorIs(t, err, coord.ErrLeaseLost, "the lost holding cannot write on the new primary")

	// The same owner renewing keeps its epoch; the next change of owner
	// goes on above the floor.
	again, ok, err := coord.Take(ctx, db, "site:s1:boot", "agent-c", time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, c.Epoch, again.Epoch)
}

// TestSynchronousFailoverLosesNoGrant: with synchronous replication a grant
// acknowledged on the old primary is on the promoted standby, at its epoch.
func TestSynchronousFailoverLosesNoGrant(t *testing.T) {
	if testing.Short() {
		t.Skip("a primary and a standby")
	}
	t.Parallel()
	ctx := context.Background()
	pair := pgha.Start(t, pgha.Options{Sync: true})
	db, err := pgdb.Connect(ctx, pgdb.Config{URL: pair.MultiHostURL(), AppName: "sync-failover", MaxConns: 4})
	require.NoError(t, err)
	defer db.Close()
	client, err := coord.NewClient(db, "worker-a")
	require.NoError(t, err)
	g, err := client.AcquireMany(ctx, []string{"shard:1", "shard:2", "singleton:janitor"}, time.Minute)
	require.NoError(t, err)
	require.Len(t, g.Leases, 3)

	require.NoError(t, pair.KillPrimary(ctx))
	require.NoError(t, pair.Promote(ctx))
	require.Eventually(t, func() bool {
		g2, err := client.AcquireMany(ctx, []string{"shard:1", "shard:2", "singleton:janitor"}, time.Minute)
		if err != nil || len(g2.Leases) != 3 {
			return false
		}
		for _, l := range g2.Leases {
			before, _ := g.Get(l.Name)
			require.Equal(t, before.Epoch, l.Epoch, "%s renewed at the epoch acknowledged before the failover", l.Name)
		}
		return true
	}, time.Minute, 100*time.Millisecond)
}

// TestKeeperEndsItsHoldingWhenTheDatabaseFailsOver: a keeper whose renewal
// lands on a promoted standby (a new timeline) drops its holding, even
// though the standby still shows it as the owner at its epoch, and takes
// the lease again at an epoch of the new timeline.
func TestKeeperEndsItsHoldingWhenTheDatabaseFailsOver(t *testing.T) {
	if testing.Short() {
		t.Skip("a primary and a standby")
	}
	t.Parallel()
	ctx := context.Background()
	pair := pgha.Start(t, pgha.Options{Sync: true})
	db, err := pgdb.Connect(ctx, pgdb.Config{URL: pair.MultiHostURL(), AppName: "keeper-failover", MaxConns: 4})
	require.NoError(t, err)
	defer db.Close()
	client, err := coord.NewClient(db, "gw-f")
	require.NoError(t, err)
	ev := newKeeperEvents()
	k, err := coord.NewKeeper(client, ev.config("gateway:gw-f", time.Minute, 200*time.Millisecond, 30*time.Second), nil)
	require.NoError(t, err)
	runKeeper(t, k)
	first := receive(t, ev.acquired, "the first take")
	require.Zero(t, first.Floor)

	require.NoError(t, pair.KillPrimary(ctx))
	require.NoError(t, pair.Promote(ctx))
	require.Contains(t, receive(t, ev.lost, "the loss at the failover"), "new timeline")
	second := receive(t, ev.acquired, "the take on the new primary")
	require.Equal(t, int64(1)<<32, second.Floor)
	require.Equal(t, second.Floor+1, second.Epoch, "a holding of the new timeline")
}
