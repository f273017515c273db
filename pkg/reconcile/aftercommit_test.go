package reconcile_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/queue"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

// TestAfterCommitRunsOnlyAfterACommit: a function registered by a failed
// attempt never runs; one registered by the attempt that commits runs
// once, when its writes are visible to other sessions.
func TestAfterCommitRunsOnlyAfterACommit(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	exec(t, db.Pool, "CREATE TABLE written (key text, attempt int)")
	var (
		mu       sync.Mutex
		attempts int
		ran      []int
		visible  []int
	)
	newRuntime(t, db, "w1", func(rt *reconcile.Runtime) {
		require.NoError(t, rt.RegisterSharded(reconcile.Sharded{Name: "nodes", Group: coord.Controllers, Poll: 20 * time.Millisecond,
			Reconcile: func(ctx context.Context, tx pgx.Tx, key string) error {
				mu.Lock()
				attempts++
				a := attempts
				mu.Unlock()
				if _, err := tx.Exec(ctx, "INSERT INTO written VALUES ($1, $2)", key, a); err != nil {
					return err
				}
				require.True(t, reconcile.AfterCommit(ctx, func() {
					n := count(t, db.Pool, "SELECT count(*) FROM written WHERE attempt = $1", a)
					mu.Lock()
					ran, visible = append(ran, a), append(visible, n)
					mu.Unlock()
				}))
				if a == 1 {
					return errors.New("first attempt fails")
				}
				return nil
			}}))
	})
	require.False(t, reconcile.AfterCommit(context.Background(), func() {}), "outside a reconcile")
	_, err := queue.Enqueue(context.Background(), db.Pool, "nodes", "node-1", 0)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(ran) > 0
	}, 30*time.Second, 20*time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []int{2}, ran, "only the committed attempt's function ran")
	require.Equal(t, []int{1}, visible, "its write was committed when it ran")
}
