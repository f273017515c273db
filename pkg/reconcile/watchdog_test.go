package reconcile_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/health"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/queue"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

// TestStalledReconcilerSelfReleases: a reconcile stuck past SelfReleaseAfter
// makes the process release every lease and fail /livez; another process
// then takes the shards at once.
func TestStalledReconcilerSelfReleases(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	stuck := make(chan struct{})
	a := newRuntime(t, db, "wa", func(rt *reconcile.Runtime) {
		require.NoError(t, rt.RegisterSharded(reconcile.Sharded{Name: "nodes", Group: coord.Controllers,
			Reconcile: func(ctx context.Context, tx pgx.Tx, key string) error {
				<-stuck // ignores ctx: a wedged call
				return nil
			}}))
	})
	t.Cleanup(func() { close(stuck) }) // runs before the runtime's stop
	h := health.New(prometheus.NewRegistry(), "")
	a.AddHealth(h)
	require.Eventually(t, func() bool { return len(a.Renewer().Shards(coord.Controllers)) == coord.NumShards }, 10*time.Second, 20*time.Millisecond)
	_, err := queue.Enqueue(context.Background(), db.Pool, "nodes", "node-z", 0)
	require.NoError(t, err)

	require.Eventually(t, func() bool {
		return count(t, db.Pool, "SELECT count(*) FROM leases WHERE owner = 'wa'") == 0
	}, 15*time.Second, 50*time.Millisecond, "the stalled process released its leases")
	require.Eventually(t, func() bool { return a.Renewer().Loop().Check(context.Background()) != nil }, 10*time.Second, 50*time.Millisecond)

	b := newRuntime(t, db, "wb", func(rt *reconcile.Runtime) {
		require.NoError(t, rt.RegisterSharded(reconcile.Sharded{Name: "nodes", Group: coord.Controllers,
			Reconcile: func(ctx context.Context, tx pgx.Tx, key string) error { return nil }}))
	})
	// wa's row is still live but silent, so its shards are orphans wb takes.
	require.Eventually(t, func() bool { return len(b.Renewer().Shards(coord.Controllers)) == coord.NumShards }, 20*time.Second, 50*time.Millisecond)
	require.Zero(t, count(t, db.Pool, "SELECT count(*) FROM leases WHERE owner = 'wa'"), "the stalled process never takes a lease again")
}
