package collector

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestPassCostsWhatItReadsNotTheTable proves with EXPLAIN (ANALYZE,
// BUFFERS) that the collector's two reads of commands touch buffers in
// proportion to what they return (commands finished since the watermark,
// commands not finished), not to the 100,000 finished commands retained
// before them. The reads they replaced scanned the table and fail the
// same bound.
func TestPassCostsWhatItReadsNotTheTable(t *testing.T) {
	if testing.Short() {
		t.Skip("seeds 100,000 commands")
	}
	db := pgtest.NewDB(t)
	ctx := context.Background()
	const retained, recent, pending, inFlight = 100000, 50, 40, 30
	_, err := db.Pool.Exec(ctx, `INSERT INTO nodes (id) SELECT 'plan-' || i FROM generate_series(0, 99) AS i`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `
INSERT INTO commands (node_id, kind, state, created_at, finished_at)
SELECT 'plan-' || (i % 100), 'plan', 'succeeded', compute_now() - interval '2 hours', compute_now() - interval '1 hour'
  FROM generate_series(1, $1) AS i`, retained)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `
INSERT INTO commands (node_id, kind, state, created_at, finished_at)
SELECT 'plan-' || (i % 100), 'plan', 'failed', compute_now() - interval '2 seconds', compute_now() FROM generate_series(1, $1) AS i`, recent)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `
INSERT INTO commands (node_id, kind, state)
SELECT 'plan-' || (i % 100), 'plan', CASE WHEN i <= $2 THEN 'dispatched' ELSE 'pending' END FROM generate_series(1, $1) AS i`, pending+inFlight, inFlight)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `ANALYZE commands`)
	require.NoError(t, err)
	var watermark time.Time
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT compute_now() - interval '1 minute'`).Scan(&watermark))

	for _, r := range []struct {
		name       string
		sql, old   string
		args       []any
		reads      int // rows the read must touch
		wantReturn int
	}{
		{"finished since the watermark", finishedSinceSQL, oldFinishedSinceSQL, []any{watermark}, recent, recent},
		{"commands not finished, by state", activeCommandsSQL, oldCommandsByStateSQL, nil, pending + inFlight, 0},
	} {
		pgtest.Explain(t, db.Pool, r.sql, r.args...) // warm the cache
		now := pgtest.Explain(t, db.Pool, r.sql, r.args...)
		old := pgtest.ExplainWithout(t, db.Pool, "commands_finished_idx", r.old, r.args...)
		bound := int64(3*r.reads + 20)
		t.Logf("%s: %d buffers (%.1f ms), bound %d; the full-scan read it replaced: %d buffers (%.1f ms)",
			r.name, now.Blocks, now.ExecMs, bound, old.Blocks, old.ExecMs)
		require.NotContains(t, now.SeqScans, "commands", "%s: no sequential scan of commands", r.name)
		require.LessOrEqual(t, now.Blocks, bound, "%s: buffers follow what it reads", r.name)
		require.Greater(t, old.Blocks, bound, "%s: the bound tells a full scan apart", r.name)
		if r.wantReturn > 0 {
			rows, err := db.Pool.Query(ctx, r.sql, r.args...)
			require.NoError(t, err)
			n := 0
			for rows.Next() {
				n++
			}
			require.NoError(t, rows.Err())
			require.Equal(t, r.wantReturn, n)
		}
	}
	// The gauge's figures themselves.
	c := New(nil, time.Minute)
	_, err = c.collect(ctx, db.Pool, watermark)
	require.NoError(t, err)
	require.InDelta(t, pending, gaugeValue(t, c, "pending"), 0)
	require.InDelta(t, inFlight, gaugeValue(t, c, "dispatched"), 0)
}

func gaugeValue(t *testing.T, c *Collector, state string) float64 {
	t.Helper()
	return testutil.ToFloat64(c.commands.WithLabelValues(state))
}

// The collector's reads before migration 00025 (explained without its
// index): each scanned the table.
const (
	oldFinishedSinceSQL = `
SELECT kind, state, extract(epoch FROM finished_at - created_at)::float8, finished_at
  FROM commands
 WHERE finished_at > $1 AND state IN ('succeeded', 'failed')
 ORDER BY finished_at
 LIMIT 100000`
	oldCommandsByStateSQL = `SELECT state, count(*) FROM commands GROUP BY state`
)
