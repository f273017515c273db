package runs_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/services/worker/internal/runs"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var cfg = runs.DefaultConfig()

// newRun writes a run over n nodes (n00..) as CreateRun would.
func newRun(t *testing.T, db *pgxpool.Pool, n, inFlight, maxFailures int, pause time.Duration) string {
	t.Helper()
	ctx := context.Background()
	var ids []string
	for i := range n {
		ids = append(ids, fmt.Sprintf("n%02d", i))
	}
	_, err := db.Exec(ctx, `INSERT INTO nodes (id) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING`, ids)
	require.NoError(t, err)
	var id string
	require.NoError(t, db.QueryRow(ctx, `
INSERT INTO runs (target, kind, payload, command_timeout, max_in_flight, max_failures, batch_pause)
VALUES ('{}', 'exec', '{"argv":["true"]}', interval '1 hour', $1, $2, make_interval(secs => $3::float8)) RETURNING id`,
		inFlight, maxFailures, pause.Seconds()).Scan(&id))
	_, err = db.Exec(ctx, `INSERT INTO run_nodes (run_id, node_id) SELECT $1, unnest($2::text[])`, id, ids)
	require.NoError(t, err)
	return id
}

func reconcileOnce(t *testing.T, db *pgxpool.Pool, runID string) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, pgdb.InTx(ctx, db, func(tx pgx.Tx) error { return runs.Reconcile(ctx, tx, runID, cfg, nil) }))
}

func nodeStates(t *testing.T, db *pgxpool.Pool, runID string) map[string]int {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT state, count(*) FROM run_nodes WHERE run_id = $1 GROUP BY state`, runID)
	require.NoError(t, err)
	out := map[string]int{}
	var s string
	var n int
	_, err = pgx.ForEachRow(rows, []any{&s, &n}, func() error { out[s] = n; return nil })
	require.NoError(t, err)
	return out
}

func runState(t *testing.T, db *pgxpool.Pool, runID string) (string, string) {
	t.Helper()
	var s, r string
	require.NoError(t, db.QueryRow(context.Background(), `SELECT state, reason FROM runs WHERE id = $1`, runID).Scan(&s, &r))
	return s, r
}

// finish ends the first k running commands of the run with state (and a
// result, as a gateway stores it).
func finish(t *testing.T, db *pgxpool.Pool, runID string, k int, state string, exit int) {
	t.Helper()
	ctx := context.Background()
	_, err := db.Exec(ctx, `
WITH c AS (
  SELECT rn.command_id, rn.node_id FROM run_nodes rn JOIN commands c ON c.id = rn.command_id
   WHERE rn.run_id = $1 AND rn.state = 'running' AND c.state NOT IN ('succeeded', 'failed', 'cancelled', 'expired')
   ORDER BY rn.node_id LIMIT $2)
, u AS (UPDATE commands SET state = $3, acked_at = compute_now(), finished_at = compute_now() WHERE id IN (SELECT command_id FROM c))
INSERT INTO command_results (node_id, command_id, id, exit_code, error, gateway_id, session_epoch)
SELECT node_id, command_id, 'r-' || command_id, $4::int, CASE WHEN $4::int = 0 THEN '' ELSE 'exit status ' || $4::int END, 'g1', 1 FROM c`,
		runID, k, state, exit)
	require.NoError(t, err)
}

func count(t *testing.T, db *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

func TestSlidingWindowStartsEachNodeOnce(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	runID := newRun(t, db, 12, 5, 0, 0)

	reconcileOnce(t, db, runID)
	require.Equal(t, map[string]int{"running": 5, "pending": 7}, nodeStates(t, db, runID))
	require.Equal(t, 5, count(t, db, `SELECT count(*) FROM commands WHERE idempotency_key LIKE 'run:' || $1 || ':%'`, runID))
	require.Equal(t, 1, count(t, db, `SELECT count(*) FROM commands WHERE node_id = 'n00' AND idempotency_key = $1 AND kind = 'exec'
	   AND deadline > compute_now() + interval '59 minutes'`, runs.CommandKey(runID, "n00")), "the first nodes by id start first")
	require.Equal(t, 1, count(t, db, `SELECT count(*) FROM work_queue WHERE reconciler = 'runs' AND key = $1`, runID), "a running run asks to run again")

	reconcileOnce(t, db, runID)
	require.Equal(t, 5, count(t, db, `SELECT count(*) FROM commands`), "a full window starts nothing")

	finish(t, db, runID, 2, "succeeded", 0)
	reconcileOnce(t, db, runID)
	require.Equal(t, map[string]int{"succeeded": 2, "running": 5, "pending": 5}, nodeStates(t, db, runID))
	require.Equal(t, 7, count(t, db, `SELECT count(*) FROM commands`))

	for range 10 {
		finish(t, db, runID, 5, "succeeded", 0)
		reconcileOnce(t, db, runID)
	}
	require.Equal(t, map[string]int{"succeeded": 12}, nodeStates(t, db, runID))
	s, _ := runState(t, db, runID)
	require.Equal(t, "succeeded", s)
	require.Equal(t, 12, count(t, db, `SELECT count(*) FROM commands`))
	require.Equal(t, 12, count(t, db, `SELECT count(DISTINCT node_id) FROM commands`), "every node once")
	require.Equal(t, 0, count(t, db, `SELECT count(*) FROM run_nodes WHERE exit_code <> 0 OR finished_at IS NULL`))
}

// TestRolledBackPassStartsNothing: a pass whose transaction does not commit
// (its worker died, or the fence refused it) leaves no command and no
// running node; a pass that finds the node's command already there (its
// idempotency key) adopts it instead of creating a second.
func TestRolledBackPassStartsNothing(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	runID := newRun(t, db, 3, 2, 0, 0)
	died := errors.New("worker died before commit")
	err := pgdb.InTx(ctx, db, func(tx pgx.Tx) error {
		require.NoError(t, runs.Reconcile(ctx, tx, runID, cfg, nil))
		return died
	})
	require.ErrorIs(t, err, died)
	require.Equal(t, map[string]int{"pending": 3}, nodeStates(t, db, runID))
	require.Equal(t, 0, count(t, db, `SELECT count(*) FROM commands`))

	// A command with the node's key exists (created by a pass of this run
	// that this state predates): the pass takes it rather than insert.
	var existing string
	require.NoError(t, db.QueryRow(ctx, `INSERT INTO commands (node_id, kind, payload, idempotency_key, deadline)
VALUES ('n00', 'exec', '{"argv":["true"]}', $1, compute_now() + interval '1 hour') RETURNING id`, runs.CommandKey(runID, "n00")).Scan(&existing))
	reconcileOnce(t, db, runID)
	require.Equal(t, 2, count(t, db, `SELECT count(*) FROM commands`))
	require.Equal(t, 1, count(t, db, `SELECT count(*) FROM run_nodes WHERE node_id = 'n00' AND command_id = $1 AND state = 'running'`, existing))
}

func TestFailureBudget(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	runID := newRun(t, db, 10, 3, 1, 0)
	reconcileOnce(t, db, runID)
	finish(t, db, runID, 1, "failed", 3)
	reconcileOnce(t, db, runID)
	require.Equal(t, map[string]int{"failed": 1, "running": 3, "pending": 6}, nodeStates(t, db, runID), "one failure is within the budget")
	require.Equal(t, 1, count(t, db, `SELECT count(*) FROM run_nodes WHERE state = 'failed' AND exit_code = 3 AND error = 'exit status 3'`))

	finish(t, db, runID, 1, "failed", 1)
	reconcileOnce(t, db, runID)
	s, reason := runState(t, db, runID)
	require.Equal(t, "failed", s)
	require.Contains(t, reason, "2 nodes failed, more than max_failures 1")
	require.Equal(t, map[string]int{"failed": 2, "running": 2, "not_started": 6}, nodeStates(t, db, runID), "running nodes finish")
	require.Equal(t, 4, count(t, db, `SELECT count(*) FROM commands`), "no node starts after the budget is spent")

	finish(t, db, runID, 2, "succeeded", 0)
	_, err := db.Exec(context.Background(), `DELETE FROM work_queue`) // as the runtime's Complete would
	require.NoError(t, err)
	reconcileOnce(t, db, runID)
	require.Equal(t, map[string]int{"failed": 2, "succeeded": 2, "not_started": 6}, nodeStates(t, db, runID))
	require.Equal(t, 0, count(t, db, `SELECT count(*) FROM work_queue WHERE key = $1`, runID), "a settled run stops asking")
	require.Equal(t, 4, count(t, db, `SELECT count(*) FROM commands`))
}

func TestExpiredCommands(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	runID := newRun(t, db, 2, 2, 5, 0)
	reconcileOnce(t, db, runID)
	// n00 never acknowledged its command (not connected); n01 did, then
	// its deadline passed.
	_, err := db.Exec(ctx, `UPDATE commands SET state = 'expired', finished_at = compute_now(),
	   acked_at = CASE WHEN node_id = 'n01' THEN compute_now() END`)
	require.NoError(t, err)
	reconcileOnce(t, db, runID)
	require.Equal(t, map[string]int{"unreachable": 1, "failed": 1}, nodeStates(t, db, runID))
	require.Equal(t, 1, count(t, db, `SELECT count(*) FROM run_nodes WHERE node_id = 'n00' AND state = 'unreachable' AND error LIKE 'node not reached%'`))
	s, reason := runState(t, db, runID)
	require.Equal(t, "failed", s, "failures within the budget still fail the run at its end")
	require.Equal(t, "2 nodes failed", reason)
}

func TestBatchPause(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	runID := newRun(t, db, 3, 1, 0, time.Hour)
	reconcileOnce(t, db, runID)
	finish(t, db, runID, 1, "succeeded", 0)
	reconcileOnce(t, db, runID)
	require.Equal(t, map[string]int{"succeeded": 1, "pending": 2}, nodeStates(t, db, runID), "the pause holds the next start")
	_, err := db.Exec(context.Background(), `UPDATE run_nodes SET finished_at = finished_at - interval '61 minutes' WHERE state = 'succeeded'`)
	require.NoError(t, err)
	reconcileOnce(t, db, runID)
	require.Equal(t, map[string]int{"succeeded": 1, "running": 1, "pending": 1}, nodeStates(t, db, runID))
}

func TestRevokedNodeSkipped(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	runID := newRun(t, db, 2, 5, 0, 0)
	_, err := db.Exec(context.Background(), `UPDATE nodes SET state = 'revoked' WHERE id = 'n01'`)
	require.NoError(t, err)
	reconcileOnce(t, db, runID)
	require.Equal(t, map[string]int{"running": 1, "skipped": 1}, nodeStates(t, db, runID))
	require.Equal(t, 0, count(t, db, `SELECT count(*) FROM commands WHERE node_id = 'n01'`))
}

func TestCommandKeyFits(t *testing.T) {
	t.Parallel()
	require.Equal(t, "run:r1:n1", runs.CommandKey("r1", "n1"))
	long := fmt.Sprintf("%0200d", 0)
	require.Equal(t, "run:r1", runs.CommandKey("r1", long), "keys are per node: the run id alone is unique")
}
