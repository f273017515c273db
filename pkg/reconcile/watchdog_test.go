package reconcile_test

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5"
	"github.com/jonboulle/clockwork"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/health"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
	"github.com/leasehold/leasehold/pkg/queue"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

// TestStalledReconcilerSelfReleases: a reconcile stuck past SelfReleaseAfter
// makes the process release every lease and fail /livez; another process
// then takes the shards. The stall is logic on the stalled process's
// injected clock: its renewal loop goes on beating at every renewal period
// while the reconcile loop does not, and the release comes at the first
// watchdog tick past SelfReleaseAfter, named after the stalled loop. The
// takeover by the second process is about the database's clock (the
// stalled member's heartbeat ageing past a TTL) and runs in real time.
func TestStalledReconcilerSelfReleases(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	stuck := make(chan struct{})
	entered := make(chan struct{})
	var once sync.Once
	_, err := queue.Enqueue(context.Background(), db.Pool, "nodes", "node-z", 0)
	require.NoError(t, err)

	clock := clockwork.NewFakeClock()
	cfg := fastConfig()
	cfg.SelfReleaseAfter = 10 * time.Second
	var logs proctest.Buffer
	// Polling only: the liveness session and LISTEN would run timers of
	// their own; the renewal loop's ticker and the watchdog's are the ones
	// this test drives.
	a, err := reconcile.New(cfg, db.Pool, reconcile.Options{Owner: "wa", Clock: clock,
		Logger: slog.New(slog.NewJSONHandler(&logs, nil)), Registerer: prometheus.NewRegistry()})
	require.NoError(t, err)
	require.NoError(t, a.RegisterSharded(reconcile.Sharded{Name: "nodes", Group: coord.Controllers,
		Reconcile: func(ctx context.Context, tx pgx.Tx, key string) error {
			once.Do(func() { close(entered) })
			<-stuck // ignores ctx: a wedged call
			return nil
		}}))
	require.NoError(t, services.StartAndAwaitRunning(context.Background(), a))
	t.Cleanup(func() { _ = services.StopAndAwaitTerminated(context.Background(), a) })
	t.Cleanup(func() { close(stuck) }) // runs before the runtime's stop
	h := health.New(prometheus.NewRegistry(), "")
	a.AddHealth(h)
	// The claim comes after the first pass, or at a poll: advance a poll at
	// a time until the reconcile has started. Its loop last beat before the
	// claim, at most a poll before stalledAt.
	deadline := time.After(20 * time.Second)
	for waiting := true; waiting; {
		select {
		case <-entered:
			waiting = false
		case <-deadline:
			t.Fatal("the reconcile never started")
		case <-time.After(20 * time.Millisecond):
			clock.Advance(cfg.Poll)
		}
	}
	require.Len(t, a.Renewer().Shards(coord.Controllers), coord.NumShards)
	stalledAt := clock.Now()

	// A second short of SelfReleaseAfter the process still holds its leases:
	// the renewal loop passes at each period (a renewer that had
	// self-released would not).
	renewed := func() bool { return a.Renewer().Loop().Age() == 0 }
	for clock.Since(stalledAt) < cfg.SelfReleaseAfter-time.Second {
		clock.Advance(cfg.Timings.Renew)
		require.Eventually(t, renewed, 10*time.Second, 2*time.Millisecond, "a renewal pass at %s", clock.Since(stalledAt))
		require.Equal(t, coord.NumShards, count(t, db.Pool, "SELECT count(*) FROM leases WHERE owner = 'wa'"),
			"leases kept %s into the stall", clock.Since(stalledAt))
	}
	require.NotContains(t, logs.String(), "loop stalled")

	// A watchdog tick past it releases every lease.
	clock.Advance(2 * time.Second)
	require.Eventually(t, func() bool {
		return count(t, db.Pool, "SELECT count(*) FROM leases WHERE owner = 'wa'") == 0
	}, 10*time.Second, 10*time.Millisecond, "the stalled process released its leases")
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "loop stalled") }, 10*time.Second, 2*time.Millisecond)
	require.Contains(t, logs.String(), `"loop":"reconcile:nodes"`, "the reconcile loop, not the renewal loop, stalled")
	// The renewer is halted: no pass beats its loop again, so /livez fails
	// once a TTL has passed on its clock.
	require.NoError(t, a.Renewer().Loop().Check(context.Background()))
	clock.Advance(cfg.Timings.LeaseTTL + time.Second)
	require.Error(t, a.Renewer().Loop().Check(context.Background()))

	b := newRuntime(t, db, "wb", func(rt *reconcile.Runtime) {
		require.NoError(t, rt.RegisterSharded(reconcile.Sharded{Name: "nodes", Group: coord.Controllers,
			Reconcile: func(ctx context.Context, tx pgx.Tx, key string) error { return nil }}))
	})
	// wa's row is still live but silent, so its shards are orphans wb takes.
	require.Eventually(t, func() bool { return len(b.Renewer().Shards(coord.Controllers)) == coord.NumShards }, 20*time.Second, 50*time.Millisecond)
	require.Zero(t, count(t, db.Pool, "SELECT count(*) FROM leases WHERE owner = 'wa'"), "the stalled process never takes a lease again")
}
