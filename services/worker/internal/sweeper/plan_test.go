package sweeper_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/services/worker/internal/sweeper"
)

// TestSweepCostsTheLiveWorkNotTheTable proves with EXPLAIN (ANALYZE,
// BUFFERS) that a sweep touches buffers in proportion to the unfinished
// commands with deadlines and the commands in flight, not to the 100,000
// finished commands retained beside them nor to a backlog of 50,000 pending
// commands without deadlines. The expiry before migration 00025 read every
// unfinished command (or the table) and fails the same bound.
func TestSweepCostsTheLiveWorkNotTheTable(t *testing.T) {
	if testing.Short() {
		t.Skip("seeds 100,000 commands")
	}
	db := pgtest.NewDB(t)
	ctx := context.Background()
	const retained, backlog, overdue, inFlight = 100000, 50000, 30, 30
	_, err := db.Pool.Exec(ctx, `INSERT INTO nodes (id) SELECT 'plan-' || i FROM generate_series(0, 99) AS i`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `
INSERT INTO commands (node_id, kind, state, deadline, created_at, finished_at)
SELECT 'plan-' || (i % 100), 'plan', 'succeeded', compute_now() - interval '1 hour', compute_now() - interval '2 hours', compute_now() - interval '1 hour'
  FROM generate_series(1, $1) AS i`, retained)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `
INSERT INTO commands (node_id, kind) SELECT 'plan-' || (i % 100), 'plan' FROM generate_series(1, $1) AS i`, backlog)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `
INSERT INTO commands (node_id, kind, state, deadline)
SELECT 'plan-' || (i % 100), 'plan', 'pending', compute_now() - interval '1 second' FROM generate_series(1, $1) AS i`, overdue)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `
INSERT INTO commands (node_id, kind, state, dispatched_at)
SELECT 'plan-' || (i % 100), 'plan', 'dispatched', compute_now() - interval '1 hour' FROM generate_series(1, $1) AS i`, inFlight)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `ANALYZE commands`)
	require.NoError(t, err)

	explain := func(sql string, args ...any) pgtest.Plan {
		tx, err := db.Pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // the sweep is only measured
		return pgtest.Explain(t, tx, sql, args...)
	}
	for _, r := range []struct {
		name    string
		sql     string
		args    []any
		changes int
	}{
		{"expire", sweeper.ExpireSQL, nil, overdue},
		{"requeue", sweeper.RequeueSQL, []any{30.0}, inFlight},
	} {
		explain(r.sql, r.args...) // warm the cache
		p := explain(r.sql, r.args...)
		// Each changed row writes a new version and its index entries.
		bound := int64(25*r.changes + 50)
		t.Logf("%s: %d buffers (%.1f ms), bound %d", r.name, p.Blocks, p.ExecMs, bound)
		require.NotContains(t, p.SeqScans, "commands", "%s: no sequential scan of commands", r.name)
		require.LessOrEqual(t, p.Blocks, bound, "%s: buffers follow the live work", r.name)
	}
	old := pgtest.ExplainWithout(t, db.Pool, "commands_deadline_idx", `UPDATE commands SET state = 'expired', finished_at = compute_now()
 WHERE state IN ('pending', 'dispatched', 'acknowledged') AND deadline < compute_now()`)
	t.Logf("the expiry before migration 00025 (its statement, without the index): %d buffers (%.1f ms)", old.Blocks, old.ExecMs)
	require.Greater(t, old.Blocks, int64(25*overdue+50), "the bound tells the old expiry apart")
}
