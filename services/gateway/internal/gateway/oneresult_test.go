package gateway

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// TestOneResultPerCommand: two results with different ids for one command
// (in one batch and in two) keep one row, the first, and the second is
// counted as ignored. The row holds one result, so the database keeps the
// rule by construction.
func TestOneResultPerCommand(t *testing.T) {
	t.Parallel()
	db, g, s := oneNodeSession(t, testConfig())
	result := func(id, rid string, exit int32) *nodev1.ConnectRequest {
		return &nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandResult{CommandResult: &nodev1.CommandResult{
			CommandId: id, ResultId: rid, ExitCode: exit}}}
	}
	a := dispatchedTo(t, db, s, "n-0")
	require.NoError(t, s.stream.Send(result(a, "first", 0)))
	s.sync(t, 1)
	require.NoError(t, s.stream.Send(result(a, "second", 7)))
	s.sync(t, 2)
	b := dispatchedTo(t, db, s, "n-0")
	require.NoError(t, s.stream.Send(result(b, "b1", 0)))
	require.NoError(t, s.stream.Send(result(b, "b2", 7)))
	s.sync(t, 3)
	for _, id := range []string{a, b} {
		var n int
		var exit int32
		require.NoError(t, db.Pool.QueryRow(context.Background(),
			`SELECT count(*), min(exit_code) FROM command_results_all WHERE command_id = $1`, id).Scan(&n, &exit))
		require.Equal(t, 1, n, "one result row for %s", id)
		require.Equal(t, int32(0), exit, "the first result is kept")
		require.Equal(t, "succeeded", commandState(t, db, id))
	}
	require.Equal(t, 2.0, testutil.ToFloat64(g.m.results.WithLabelValues("ignored")))

}

// TestResultStoredByThePreviousReleaseCounts: a command whose result a
// gateway of the previous release stored in command_results (during a
// rolling upgrade) gets no second result in its row: the same id is a
// duplicate, another id is ignored, and readers see the one result.
func TestResultStoredByThePreviousReleaseCounts(t *testing.T) {
	t.Parallel()
	db, g, s := oneNodeSession(t, testConfig())
	a := dispatchedTo(t, db, s, "n-0")
	// What the previous release's group commit wrote for a result.
	_, err := db.Pool.Exec(context.Background(), `
WITH ins AS (
  INSERT INTO command_results (node_id, id, command_id, exit_code, gateway_id, session_epoch)
  VALUES ('n-0', 'old', $1, 3, 'gw-old', 1) RETURNING command_id)
UPDATE commands SET state = 'failed', finished_at = compute_now() FROM ins WHERE id = ins.command_id`, a)
	require.NoError(t, err)
	for i, rid := range []string{"old", "new"} {
		require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandResult{
			CommandResult: &nodev1.CommandResult{CommandId: a, ResultId: rid, ExitCode: 0}}}))
		s.sync(t, uint64(i+1))
	}
	var n int
	var rid string
	var inRow bool
	require.NoError(t, db.Pool.QueryRow(context.Background(), `
SELECT (SELECT count(*) FROM command_results_all WHERE command_id = $1),
       (SELECT id FROM command_results_all WHERE command_id = $1 LIMIT 1),
       (SELECT result_id IS NOT NULL FROM commands WHERE id = $1)`, a).Scan(&n, &rid, &inRow))
	require.Equal(t, 1, n)
	require.Equal(t, "old", rid)
	require.False(t, inRow, "nothing stored in the command's row")
	require.Equal(t, "failed", commandState(t, db, a))
	require.Equal(t, 1.0, testutil.ToFloat64(g.m.results.WithLabelValues("duplicate")))
	require.Equal(t, 1.0, testutil.ToFloat64(g.m.results.WithLabelValues("ignored")))
}
