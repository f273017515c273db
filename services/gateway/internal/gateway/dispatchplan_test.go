package gateway

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgtest"
)

// planCost is what one dispatch call cost and took.
type planCost struct {
	pgtest.Plan
	rows int64 // commands dispatched
}

// explainDispatch runs dispatchSQL under EXPLAIN (ANALYZE, BUFFERS) in a
// transaction it rolls back, so the pending commands stay pending.
func explainDispatch(t *testing.T, db *pgtest.DB, sql string, args ...any) planCost {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // after a commit, or when the test already failed, there is nothing to report
	c := planCost{Plan: pgtest.Explain(t, tx, sql, args...)}
	// What the call dispatched, seen inside the transaction (rolled back).
	require.NoError(t, tx.QueryRow(ctx, "SELECT count(*) FROM commands WHERE state = 'dispatched'").Scan(&c.rows))
	return c
}

// TestDispatchPlanIsOBatch proves, with EXPLAIN (ANALYZE, BUFFERS), that a
// dispatch call costs the same with 100,000 pending commands as with 300:
// the buffers it touches stay within 2x, it takes the same batch, and
// nothing is sorted on disk. Buffers, not times, are asserted: they do not
// depend on how busy the machine is.
func TestDispatchPlanIsOBatch(t *testing.T) {
	if testing.Short() {
		t.Skip("seeds 100,000 commands")
	}
	db := pgtest.NewDB(t)
	ctx := context.Background()
	const nodes, batch, gw = 300, 500, "gw-plan"
	registerNodes(t, db, "plan", nodes)
	_, err := db.Pool.Exec(ctx, `
INSERT INTO node_sessions (node_id, gateway_id, session_epoch, session_expires_at)
SELECT id, $1, 1, compute_now() + interval '1 hour' FROM nodes`, gw)
	require.NoError(t, err)
	ids := make([]string, nodes)
	epochs := make([]int64, nodes)
	lims := make([]int32, nodes)
	for i := range ids {
		ids[i], epochs[i], lims[i] = fmt.Sprintf("plan-%d", i), 1, int32((batch+nodes-1)/nodes)
	}
	seed := func(n int) {
		_, err := db.Pool.Exec(ctx, `
INSERT INTO commands (node_id, kind, created_at)
SELECT 'plan-' || (i % $1), 'plan', compute_now() + make_interval(secs => i / 1000.0)
  FROM generate_series(1, $2) AS i`, nodes, n)
		require.NoError(t, err)
		_, err = db.Pool.Exec(ctx, `ANALYZE commands`)
		require.NoError(t, err)
	}

	perRow := func(c planCost) float64 { return float64(c.Blocks) / float64(c.rows) }
	seed(300)
	explainDispatch(t, db, dispatchSQL, gw, ids, epochs, lims, batch) // warm the cache
	small := explainDispatch(t, db, dispatchSQL, gw, ids, epochs, lims, batch)
	smallSorted := explainDispatch(t, db, sortedDispatchSQL, gw, ids, epochs, batch)
	seed(100000 - 300)
	explainDispatch(t, db, dispatchSQL, gw, ids, epochs, lims, batch)
	large := explainDispatch(t, db, dispatchSQL, gw, ids, epochs, lims, batch)
	largeSorted := explainDispatch(t, db, sortedDispatchSQL, gw, ids, epochs, batch)
	if os.Getenv("LEASEHOLD_DISPATCH_PLAN") != "" {
		dumpPlan(t, db, gw, ids, epochs, lims, batch)
	}
	for _, r := range []struct {
		name       string
		small, big planCost
	}{{"per-node pick", small, large}, {"sorted join (before)", smallSorted, largeSorted}} {
		t.Logf("%s: 300 pending: %d buffers for %d commands (%.1f/command, %.1f ms); 100,000 pending: %d buffers for %d (%.1f/command, %.1f ms, sort on disk %v)",
			r.name, r.small.Blocks, r.small.rows, perRow(r.small), r.small.ExecMs, r.big.Blocks, r.big.rows, perRow(r.big), r.big.ExecMs, r.big.SortOnDisk)
	}

	require.Equal(t, int64(nodes), small.rows, "300 pending, one per node: all dispatched")
	require.Equal(t, int64(batch), large.rows, "a full batch")
	require.False(t, large.SortOnDisk, "no sort on disk")
	require.LessOrEqual(t, perRow(large), 2*perRow(small), "buffers per dispatched command with 100,000 pending stay within 2x of 300 pending")
	// The bound tells the two plans apart: the sorted join it replaced
	// reads every pending command.
	require.Greater(t, perRow(largeSorted), 2*perRow(smallSorted), "the old plan grows with the backlog")
}

// sortedDispatchSQL is the dispatch statement before the O(batch) dispatch: it joins
// every pending command of the gateway's sessions and sorts them all.
const sortedDispatchSQL = `
WITH mine AS (
  SELECT * FROM unnest($2::text[], $3::bigint[]) AS m(node_id, epoch)
), picked AS (
  SELECT c.id
    FROM commands c
    JOIN node_sessions s ON s.node_id = c.node_id
    JOIN mine m ON m.node_id = s.node_id AND m.epoch = s.session_epoch
   WHERE c.state = 'pending' AND s.gateway_id = $1
     AND (c.deadline IS NULL OR c.deadline > compute_now())
   ORDER BY c.created_at
   LIMIT $4
   FOR UPDATE OF c SKIP LOCKED
)
UPDATE commands c SET
  state = 'dispatched',
  dispatch_count = c.dispatch_count + 1,
  dispatched_at = compute_now(),
  dispatched_by = $1,
  dispatch_epoch = s.session_epoch
  FROM picked, node_sessions s
 WHERE c.id = picked.id AND s.node_id = c.node_id
RETURNING c.id`

func dumpPlan(t *testing.T, db *pgtest.DB, gw string, ids []string, epochs []int64, lims []int32, batch int) {
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // after a commit, or when the test already failed, there is nothing to report
	rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS) "+dispatchSQL, gw, ids, epochs, lims, batch)
	require.NoError(t, err)
	for rows.Next() {
		var l string
		require.NoError(t, rows.Scan(&l))
		t.Log(l)
	}
}
