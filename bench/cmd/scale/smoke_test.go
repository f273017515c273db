package main

import (
	"context"
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/bench/internal/fleet"
	"github.com/leasehold/leasehold/bench/internal/harness"
)

// TestScaleSmoke runs the scale model briefly: 20 then 60 nodes on one
// gateway, an idle window and a commands window (one command per node per
// second, so that there are some) at each size, and the fit.
func TestScaleSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	if _, err := exec.LookPath("haproxy"); err != nil {
		t.Skip("haproxy not installed")
	}
	t.Setenv("LEASEHOLD_DATABASE_URL", "") // a throwaway local cluster: its CPU is read from /proc
	c := config{nodes: []int{20, 60}, gateways: 1, perProcess: 40, helloRate: 200, creators: 4, perNodePerMinute: 60,
		commands: true, warmup: time.Second, commandWarmup: time.Second, window: 3 * time.Second,
		drain: 10 * time.Second, headroom: 0.5, cores: []int{2, 8}, producer: "sql"}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	sup := &harness.Supervisor{}
	defer sup.Stop()
	res, err := run(ctx, c, sup, func(*fleet.Fleet) {})
	require.NoError(t, err)
	require.Len(t, res.Steps, 2)
	for _, s := range res.Steps {
		require.Equal(t, s.Nodes, s.Idle.Connected)
		require.EqualValues(t, s.Nodes, s.Idle.DBConnected)
		// Idle, PostgreSQL may spend less than one clock tick (10 ms)
		// in a 3 s window: its CPU is read, but only the commands window
		// is sure to show some.
		require.GreaterOrEqual(t, s.Idle.PGCPU, 0.0)
		require.Positive(t, s.Idle.Statements)
		require.Positive(t, s.Idle.ConnsMax)
		require.NotNil(t, s.Commands)
		require.Positive(t, s.Commands.PGCPU)
		require.Positive(t, s.Commands.CompletedPS)
		require.NotNil(t, s.Commands.Latency)
		require.Positive(t, s.Commands.Latency.N)
	}
	require.NotNil(t, res.Idle)
	require.NotNil(t, res.Commands)
	t.Logf("commands: %.4f s/s + %.4f s/s per 1,000 nodes", res.Commands.Fixed, res.Commands.PerThousand)
}
