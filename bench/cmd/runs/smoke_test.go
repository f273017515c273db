package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestRunsSmoke runs the runs bench briefly: 20 in-process node daemons, a
// 1 s idle window, one run over every node with max_in_flight 5, then 20
// single commands 5 at a time. The run must succeed with every node's
// command executed once and never more than 5 at a time, every single
// command must succeed and execute once, and each phase's statements must be
// counted (pg_stat_statements).
func TestRunsSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	t.Setenv("LEASEHOLD_DATABASE_URL", "") // a throwaway local cluster
	c := config{nodes: 20, inFlight: 5, idle: time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	res, err := run(ctx, c)
	require.NoError(t, err)
	require.Len(t, res.Phases, 2)
	runPhase, singles := res.Phases[0], res.Phases[1]
	require.Equal(t, "run", runPhase.Name)
	require.True(t, strings.HasPrefix(runPhase.Outcome, "RUN_STATE_SUCCEEDED "), "run outcome: %s", runPhase.Outcome)
	require.Equal(t, "single commands", singles.Name)
	require.Equal(t, fmt.Sprintf(`{"COMMAND_STATE_SUCCEEDED":%d}`, c.nodes), singles.Outcome)
	for _, p := range res.Phases {
		require.Equal(t, c.nodes, p.Executions, "%s: one execution per node", p.Name)
		require.Positive(t, p.MaxConcurrent, p.Name)
		require.LessOrEqual(t, p.MaxConcurrent, c.inFlight, p.Name)
		require.Positive(t, p.Statements, p.Name)
		require.NotEmpty(t, p.Top, p.Name)
	}
	var out strings.Builder
	require.NoError(t, res.report(&out, ""))
	require.Contains(t, out.String(), "runs bench: 20 nodes, 5 in flight")
	t.Logf("statements per node: run %.1f, single commands %.1f (net of idle %.1f, %.1f)", runPhase.PerNode, singles.PerNode,
		runPhase.PerNodeNet, singles.PerNodeNet)
}
