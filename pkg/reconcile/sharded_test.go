package reconcile_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/queue"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

func TestShardedReconcilerRunsEveryKeyFenced(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	exec(t, db.Pool, "CREATE TABLE reconciled (key text, owner text)")
	newRuntime(t, db, "w1", func(rt *reconcile.Runtime) {
		require.NoError(t, rt.RegisterSharded(reconcile.Sharded{Name: "nodes", Group: coord.Controllers,
			Reconcile: func(ctx context.Context, tx pgx.Tx, key string) error {
				_, err := tx.Exec(ctx, "INSERT INTO reconciled VALUES ($1, 'w1')", key)
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
	require.Equal(t, 200, count(t, db.Pool, "SELECT count(DISTINCT key) FROM reconciled"))
	require.Equal(t, 200, count(t, db.Pool, "SELECT count(*) FROM reconciled"), "each key ran once")
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

// TestFailingKeyBacksOffAndRecordsError: a key whose reconcile fails stays
// queued with the error recorded, and is tried again until it succeeds.
// The reconcile keeps failing until the test has seen the error in the
// queue, so the check does not depend on catching a window between two
// tries (a loaded machine can sleep through one).
func TestFailingKeyBacksOffAndRecordsError(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	var runs atomic.Int32
	var seen atomic.Bool
	newRuntime(t, db, "w1", func(rt *reconcile.Runtime) {
		require.NoError(t, rt.RegisterSharded(reconcile.Sharded{Name: "nodes", Group: coord.Controllers,
			Reconcile: func(ctx context.Context, tx pgx.Tx, key string) error {
				if runs.Add(1) < 3 || !seen.Load() {
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
	}, time.Minute, 10*time.Millisecond, "the failure is recorded on the queued key")
	seen.Store(true)
	require.Eventually(t, func() bool { return count(t, db.Pool, "SELECT count(*) FROM work_queue") == 0 }, time.Minute, 20*time.Millisecond,
		"the key is tried again and, succeeding, leaves the queue")
	require.GreaterOrEqual(t, runs.Load(), int32(3), "two failures, then the success")
}
