package runs_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/services/worker/internal/runs"
)

// TestFinishedRunsCostsTheRunningNodes proves with EXPLAIN (ANALYZE,
// BUFFERS) that the wake-up's read of runs with a finished command (run at
// every batch of finished commands) touches buffers in proportion to the
// running run nodes, not to the 50,000 commands retained: with no run
// going, a fleet's command traffic must not pay a scan of commands per
// batch. run_nodes is left unanalyzed, as on a fresh install.
func TestFinishedRunsCostsTheRunningNodes(t *testing.T) {
	if testing.Short() {
		t.Skip("seeds 50,000 commands")
	}
	db := pgtest.NewDB(t)
	ctx := context.Background()
	const retained, running = 50000, 20
	_, err := db.Pool.Exec(ctx, `INSERT INTO nodes (id) SELECT 'n' || lpad(i::text, 2, '0') FROM generate_series(0, $1 - 1) AS i`, running)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `
INSERT INTO commands (node_id, kind, state, finished_at)
SELECT 'n' || lpad((i % $2)::text, 2, '0'), 'plan', 'succeeded', compute_now() FROM generate_series(1, $1) AS i`, retained, running)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `ANALYZE commands`)
	require.NoError(t, err)

	// No run at all: the commonest case, and the one a scan would cost most.
	pgtest.Explain(t, db.Pool, runs.FinishedRunsSQL)
	idle := pgtest.Explain(t, db.Pool, runs.FinishedRunsSQL)
	t.Logf("no run: %d buffers (%.1f ms)", idle.Blocks, idle.ExecMs)
	require.NotContains(t, idle.SeqScans, "commands", "no run: no sequential scan of commands")
	require.LessOrEqual(t, idle.Blocks, int64(20), "no run: next to nothing read")

	runID := newRun(t, db.Pool, running, running, 0, 0)
	// Each running node's command: half of them finished.
	_, err = db.Pool.Exec(ctx, `
WITH c AS (
  INSERT INTO commands (node_id, kind, state)
  SELECT node_id, 'plan', CASE WHEN row_number() OVER (ORDER BY node_id) % 2 = 0 THEN 'succeeded' ELSE 'dispatched' END
    FROM run_nodes WHERE run_id = $1
  RETURNING id, node_id)
UPDATE run_nodes rn SET state = 'running', command_id = c.id FROM c WHERE rn.run_id = $1 AND rn.node_id = c.node_id`, runID)
	require.NoError(t, err)

	pgtest.Explain(t, db.Pool, runs.FinishedRunsSQL) // warm the cache
	got := pgtest.Explain(t, db.Pool, runs.FinishedRunsSQL)
	bound := int64(4*running + 20)
	t.Logf("finished runs: %d buffers (%.1f ms), bound %d", got.Blocks, got.ExecMs, bound)
	require.NotContains(t, got.SeqScans, "commands", "no sequential scan of commands")
	require.LessOrEqual(t, got.Blocks, bound, "buffers follow the running run nodes")
	var n int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM (`+runs.FinishedRunsSQL+`) x`).Scan(&n))
	require.Equal(t, 1, n, "the run has finished commands")
}
