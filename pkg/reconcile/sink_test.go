package reconcile_test

import (
	"context"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

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
