package placer

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// seed makes pool p1 with connected nodes n1..n3 and one pending lease of
// count nodes.
func seed(t *testing.T, db *pgtest.DB, count int) {
	t.Helper()
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `INSERT INTO pools (id) VALUES ('p1')`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `INSERT INTO nodes (id, state, pool_id) VALUES ('n1', 'connected', 'p1'), ('n2', 'connected', 'p1'), ('n3', 'connected', 'p1')`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `INSERT INTO pool_leases (id, pool_id, tenant, count) VALUES ('l1', 'p1', 't', $1)`, count)
	require.NoError(t, err)
}

func allocated(t *testing.T, db *pgtest.DB) []string {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), `SELECT node_id FROM node_allocations ORDER BY node_id`)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return ids
}

// place runs one placement of p1 in its own committed transaction.
func place(t *testing.T, db *pgtest.DB) int {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	n, err := Place(ctx, tx, "p1", DefaultConfig())
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	return n
}

// cordonSQL is what the api's CordonNode does to the row.
const cordonSQL = `UPDATE nodes SET cordoned_at = compute_now() WHERE id = $1 AND cordoned_at IS NULL`

func TestPlaceSkipsCordonedNodes(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	seed(t, db, 3)
	_, err := db.Pool.Exec(context.Background(), cordonSQL, "n2")
	require.NoError(t, err)
	require.Equal(t, 2, place(t, db))
	require.Equal(t, []string{"n1", "n3"}, allocated(t, db))
	var state string
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT state FROM pool_leases WHERE id = 'l1'`).Scan(&state))
	require.Equal(t, "pending", state, "a lease short of nodes waits; it does not take the cordoned one")

	// Uncordoned, the node is placed on the next pass.
	_, err = db.Pool.Exec(context.Background(), `UPDATE nodes SET cordoned_at = NULL WHERE id = 'n2'`)
	require.NoError(t, err)
	require.Equal(t, 1, place(t, db))
	require.Equal(t, []string{"n1", "n2", "n3"}, allocated(t, db))
}

// TestPlaceSkipsANodeBeingCordoned: a cordon in flight (its transaction
// holds the row) while the placer runs: the placer passes the node over,
// and once the cordon commits the node has no allocation.
func TestPlaceSkipsANodeBeingCordoned(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	seed(t, db, 3)
	ctx := context.Background()
	cordon, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer cordon.Rollback(ctx) //nolint:errcheck // committed below
	_, err = cordon.Exec(ctx, cordonSQL, "n1")
	require.NoError(t, err)

	require.Equal(t, 2, place(t, db))
	require.NoError(t, cordon.Commit(ctx))
	require.Equal(t, []string{"n2", "n3"}, allocated(t, db))
	require.Zero(t, place(t, db), "a cordoned node is not placed later either")
	require.Equal(t, []string{"n2", "n3"}, allocated(t, db))
}

// TestCordonWaitsForAPlacementInFlight: the placer has locked and allocated
// the node but not committed; a cordon of it waits for the placement, so
// when the cordon returns the allocation is visible (a drain waits for it).
func TestCordonWaitsForAPlacementInFlight(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	seed(t, db, 1)
	ctx := context.Background()
	placer, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer placer.Rollback(ctx) //nolint:errcheck // committed below
	n, err := Place(ctx, placer, "p1", DefaultConfig())
	require.NoError(t, err)
	require.Equal(t, 1, n)

	// The cordon's transaction names itself: behind PgBouncer a client's
	// pid is not its backend's, but a transaction keeps its backend.
	cordon, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer cordon.Rollback(ctx) //nolint:errcheck // committed below
	_, err = cordon.Exec(ctx, `SET LOCAL application_name = 'placer-test-cordon'`)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		_, err := cordon.Exec(ctx, cordonSQL, "n1")
		done <- err
	}()
	// The cordon is blocked on the placer's row lock.
	require.Eventually(t, func() bool {
		var waiting bool
		_ = db.Pool.QueryRow(ctx, `SELECT coalesce(bool_or(wait_event_type = 'Lock'), false) FROM pg_stat_activity
			WHERE application_name = 'placer-test-cordon'`).Scan(&waiting)
		return waiting
	}, 10*time.Second, 10*time.Millisecond)
	select {
	case err := <-done:
		t.Fatalf("cordon returned while the placement was uncommitted: %v", err)
	default:
	}
	require.NoError(t, placer.Commit(ctx))
	require.NoError(t, <-done)
	require.NoError(t, cordon.Commit(ctx))
	require.Equal(t, []string{"n1"}, allocated(t, db), "the cordon returned after the allocation it must wait for")
}
