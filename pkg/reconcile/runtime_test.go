package reconcile_test

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/health"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/queue"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func fastConfig() reconcile.Config {
	cfg := reconcile.DefaultConfig()
	cfg.Timings = coord.Timings{LeaseTTL: 3 * time.Second, Renew: time.Second, LiveWindow: 6 * time.Second, ForgetAfter: time.Minute}
	cfg.Poll = 50 * time.Millisecond
	cfg.SelfReleaseAfter = 2 * time.Second
	cfg.Backoff = queue.Backoff{Base: 50 * time.Millisecond, Max: 200 * time.Millisecond}
	return cfg
}

func newRuntime(t *testing.T, db *pgtest.DB, owner string, register func(rt *reconcile.Runtime)) *reconcile.Runtime {
	t.Helper()
	rt, err := reconcile.New(fastConfig(), db.Pool, reconcile.Options{Owner: owner, NotifyURL: db.DirectURL, Registerer: prometheus.NewRegistry()})
	require.NoError(t, err)
	register(rt)
	require.NoError(t, services.StartAndAwaitRunning(context.Background(), rt))
	t.Cleanup(func() { _ = services.StopAndAwaitTerminated(context.Background(), rt) })
	return rt
}

func exec(t *testing.T, db *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	_, err := db.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
}

func count(t *testing.T, db *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

func TestShardedReconcilerRunsEveryKeyFenced(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	exec(t, db.Pool, "CREATE TABLE runs (key text, owner text)")
	newRuntime(t, db, "w1", func(rt *reconcile.Runtime) {
		require.NoError(t, rt.RegisterSharded(reconcile.Sharded{Name: "nodes", Group: coord.Controllers,
			Reconcile: func(ctx context.Context, tx pgx.Tx, key string) error {
				_, err := tx.Exec(ctx, "INSERT INTO runs VALUES ($1, 'w1')", key)
				return err
			}}))
	})
	keys := make([]string, 200)
	for i := range keys {
		keys[i] = fmt.Sprintf("node-%d", i)
	}
	_, err := queue.EnqueueMany(context.Background(), db.Pool, "nodes", keys, 0)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return count(t, db.Pool, "SELECT count(*) FROM work_queue") == 0 }, 20*time.Second, 50*time.Millisecond)
	require.Equal(t, 200, count(t, db.Pool, "SELECT count(DISTINCT key) FROM runs"))
	require.Equal(t, 200, count(t, db.Pool, "SELECT count(*) FROM runs"), "each key ran once")
}

// TestGenerationRaceRunsAgain: an enqueue during a running reconcile makes
// the key run again; nothing is lost.
func TestGenerationRaceRunsAgain(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	var runs atomic.Int32
	var after atomic.Bool
	inRun := make(chan struct{})
	release := make(chan struct{})
	newRuntime(t, db, "w1", func(rt *reconcile.Runtime) {
		require.NoError(t, rt.RegisterSharded(reconcile.Sharded{Name: "nodes", Group: coord.Controllers,
			Reconcile: func(ctx context.Context, tx pgx.Tx, key string) error {
				if key == "node-after" {
					after.Store(true)
					return nil
				}
				if runs.Add(1) == 1 {
					close(inRun)
					<-release
				}
				return nil
			}}))
	})
	_, err := queue.Enqueue(context.Background(), db.Pool, "nodes", "node-x", 0)
	require.NoError(t, err)
	<-inRun
	_, err = queue.Enqueue(context.Background(), db.Pool, "nodes", "node-x", 0) // generation 2 during run 1
	require.NoError(t, err)
	close(release)
	require.Eventually(t, func() bool { return runs.Load() == 2 && count(t, db.Pool, "SELECT count(*) FROM work_queue") == 0 },
		10*time.Second, 20*time.Millisecond)
	// A key enqueued later has run: any third run of node-x would have too.
	_, err = queue.Enqueue(context.Background(), db.Pool, "nodes", "node-after", 0)
	require.NoError(t, err)
	require.Eventually(t, after.Load, 10*time.Second, 10*time.Millisecond)
	require.EqualValues(t, 2, runs.Load(), "ran again once, not more")
}

func TestFailingKeyBacksOffAndRecordsError(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	var runs atomic.Int32
	newRuntime(t, db, "w1", func(rt *reconcile.Runtime) {
		require.NoError(t, rt.RegisterSharded(reconcile.Sharded{Name: "nodes", Group: coord.Controllers,
			Reconcile: func(ctx context.Context, tx pgx.Tx, key string) error {
				if runs.Add(1) < 3 {
					return fmt.Errorf("bmc unreachable")
				}
				return nil
			}}))
	})
	_, err := queue.Enqueue(context.Background(), db.Pool, "nodes", "node-y", 0)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		var lastErr *string
		_ = db.Pool.QueryRow(context.Background(), "SELECT last_error FROM work_queue WHERE key = 'node-y'").Scan(&lastErr)
		return lastErr != nil && *lastErr == "bmc unreachable"
	}, 10*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool { return count(t, db.Pool, "SELECT count(*) FROM work_queue") == 0 }, 10*time.Second, 20*time.Millisecond)
	require.EqualValues(t, 3, runs.Load())
}

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
	holder := a
	if count(t, db.Pool, "SELECT count(*) FROM periods WHERE owner = 'wb'") > 0 {
		holder = b
	}
	require.NoError(t, services.StopAndAwaitTerminated(context.Background(), holder))
	before := count(t, db.Pool, "SELECT count(DISTINCT owner) FROM periods")
	require.Equal(t, 1, before)
	require.Eventually(t, func() bool { return count(t, db.Pool, "SELECT count(DISTINCT owner) FROM periods") == 2 }, 10*time.Second, 20*time.Millisecond)
	// A few periods past the takeover, so a skip or repeat there would show.
	survivor := "wa"
	if holder == a {
		survivor = "wb"
	}
	require.Eventually(t, func() bool {
		return count(t, db.Pool, "SELECT count(*) FROM periods WHERE owner = $1", survivor) >= 3
	}, 10*time.Second, 20*time.Millisecond)

	rows, err := db.Pool.Query(context.Background(), "SELECT period FROM periods ORDER BY period")
	require.NoError(t, err)
	periods, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	for i := 1; i < len(periods); i++ {
		require.Equal(t, periods[i-1]+1, periods[i], "periods are consecutive: no skip, no repeat (%v)", periods)
	}
}

// TestSinkDeliversEveryRecordAcrossTakeover: at-least-once delivery from the
// saved cursor across a forced takeover.
func TestSinkDeliversEveryRecordAcrossTakeover(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	exec(t, db.Pool, "CREATE TABLE events (id bigint PRIMARY KEY)")
	exec(t, db.Pool, "INSERT INTO events SELECT generate_series(1, 500)")
	var mu sync.Mutex
	got := map[int64]int{}
	sink := reconcile.Sink{ID: "audit", Limit: 20, Idle: 20 * time.Millisecond,
		Fetch: func(ctx context.Context, db *pgxpool.Pool, cursor reconcile.Cursor, limit int) (any, reconcile.Cursor, int, error) {
			rows, err := db.Query(ctx, "SELECT id FROM events WHERE id > $1 ORDER BY id LIMIT $2", cursor.Seq, limit)
			if err != nil {
				return nil, cursor, 0, err
			}
			ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			if err != nil || len(ids) == 0 {
				return nil, cursor, 0, err
			}
			return ids, reconcile.Cursor{Seq: ids[len(ids)-1]}, len(ids), nil
		},
		Deliver: func(ctx context.Context, batch any) error {
			time.Sleep(5 * time.Millisecond) // the injected pace: a delivery takes time, so the takeover lands mid-stream
			mu.Lock()
			defer mu.Unlock()
			for _, id := range batch.([]int64) {
				got[id]++
			}
			return nil
		}}
	reg := func(rt *reconcile.Runtime) { require.NoError(t, rt.RegisterSink(sink)) }
	a := newRuntime(t, db, "wa", reg)
	b := newRuntime(t, db, "wb", reg)
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(got) >= 100 }, 10*time.Second, 5*time.Millisecond)
	_, aHolds := a.Renewer().Lease("singleton:sink:audit")
	if aHolds {
		require.NoError(t, services.StopAndAwaitTerminated(context.Background(), a))
	} else {
		require.NoError(t, services.StopAndAwaitTerminated(context.Background(), b))
	}
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(got) == 500 }, 20*time.Second, 10*time.Millisecond)
	var missing []int64
	for id := int64(1); id <= 500; id++ {
		if got[id] == 0 {
			missing = append(missing, id)
		}
	}
	sort.Slice(missing, func(i, j int) bool { return missing[i] < missing[j] })
	require.Empty(t, missing)
	require.Eventually(t, func() bool {
		return count(t, db.Pool, "SELECT cursor FROM sink_cursors WHERE sink_id = 'audit'") == 500
	},
		5*time.Second, 10*time.Millisecond, "the cursor is saved after the last delivered batch")
}

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
