package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/bench/internal/fleet"
	"github.com/leasehold/leasehold/pkg/pglocal"
)

// TestDBFailoverSmoke runs the database failover bench in its smallest
// form: the restart scenario alone (a fast stop and start of the primary,
// its synchronous standby reconnecting) under the whole control plane with
// the fast timings, 5 simulated nodes and 10 commands/s through the api for
// a 3 s warmup and 2 s after recovery. The control plane must ride through
// in place: every lease held before the fault held again, every process
// ready and none exited, every node connected again, every acknowledged
// command completed and none run twice, and no lease seen with two holders.
func TestDBFailoverSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	if _, err := exec.LookPath("haproxy"); err != nil {
		t.Skip("haproxy not installed")
	}
	bin, err := pglocal.BinDir()
	if err != nil {
		t.Skip(err)
	}
	if _, err := os.Stat(filepath.Join(bin, "pg_basebackup")); err != nil {
		t.Skip("pg_basebackup not installed: the standby is a base backup")
	}
	c := config{scenarios: []string{"restart"}, outage: time.Second, nodes: 5, rate: 10, warmup: 3 * time.Second,
		after: 2 * time.Second, recoverTimeout: time.Minute, timings: fleet.Fast, progress: true}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var kill func()
	defer func() {
		if kill != nil {
			kill()
		}
	}()
	res, err := runAll(ctx, c, func(k func()) { kill = k })
	require.NoError(t, err)
	require.Len(t, res.Scenarios, 1)
	s := res.Scenarios[0]
	require.Equal(t, "restart", s.Scenario)
	require.Equal(t, "synchronous", s.Replication)
	require.Empty(t, s.Error)
	require.Positive(t, s.Leases, "leases held before the fault")
	require.Positive(t, s.LeasesBack, "every lease held again")
	require.Positive(t, s.ReadyBack, "every process ready again")
	require.GreaterOrEqual(t, s.NodesBack, 0.0, "every node connected again")
	require.Zero(t, s.Restarted, "processes exited: %+v", s.Processes)
	require.Positive(t, s.Acknowledged)
	require.Equal(t, s.Acknowledged, s.Completed, "every acknowledged command completed")
	require.Zero(t, s.Lost)
	require.Zero(t, s.LostAbsent)
	require.GreaterOrEqual(t, s.Executions, int64(s.Completed))
	require.Zero(t, s.Duplicates)
	require.Zero(t, s.overlaps(), "two holders: %v", s.TwoHoldersSeen)
	require.Positive(t, s.HolderPairsSeen)
	require.Positive(t, s.LogRows)
	t.Logf("restart: database down %.1f s; leases back %.1f s, processes ready %.1f s, nodes %.1f s after; %d acknowledged, %d create calls failed",
		s.Down, s.LeasesBack, s.ReadyBack, s.NodesBack, s.Acknowledged, s.CreateFailed)
}
