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

// TestThroughputSmoke runs the throughput bench briefly: 20 nodes in a
// nodesim process behind one gateway, then River with one working client
// (MaxWorkers 10), each fed by 4 creators paced to 100 creates/s for a 1 s
// warmup and a 2 s window, with no insert ceiling and no backlog. Each side
// must complete commands in the window and, after the drain, every one it
// created (its latency is read from every completed row), with its costs
// per command read from pg_stat_statements; the ratio is computed.
func TestThroughputSmoke(t *testing.T) {
	skipWithoutProcesses(t)
	c := config{nodes: 20, gateways: []int{1}, concurrency: 4, rate: 100, riverWorkers: []int{10}, river: true,
		warmup: time.Second, window: 2 * time.Second, drain: time.Minute, producer: "sql", nodesProcess: true}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	sup := &harness.Supervisor{}
	defer sup.Stop()
	res, err := run(ctx, c, sup, func(*fleet.Fleet) {})
	require.NoError(t, err)
	require.Nil(t, res.Ceiling)
	require.Nil(t, res.Backlog)
	require.Len(t, res.Results, 2)
	lh, rv := res.Results[0], res.Results[1]
	require.Equal(t, "leasehold", lh.System)
	require.Equal(t, 1, lh.Gateways)
	require.Equal(t, "River", rv.System)
	require.Equal(t, 10, rv.RiverWorkers)
	for _, m := range res.Results {
		require.Positive(t, m.Created, m.System)
		require.Positive(t, m.Completed, m.System)
		require.Zero(t, m.Unfinished, m.System)
		require.EqualValues(t, m.Created, m.Latency.N, "%s: every created command completed after the drain", m.System)
		require.Positive(t, m.Statements, m.System)
		require.Positive(t, m.Commits, m.System)
		require.NotEmpty(t, m.Costliest, m.System)
	}
	require.Positive(t, lh.DispatchCallP50, "the gateway's dispatch calls over the window")
	require.Positive(t, res.RiverBest)
	require.Positive(t, res.Ratio1)
	t.Logf("leasehold 1 gateway %.0f completed/s, River %.0f completed/s (paced to %.0f/s)", lh.CompletedPS, rv.CompletedPS, c.rate)
}

// skipWithoutProcesses skips a run of real processes under -short or
// without haproxy, and points the run at a throwaway local cluster (its CPU
// is read from /proc).
func skipWithoutProcesses(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("real processes")
	}
	if _, err := exec.LookPath("haproxy"); err != nil {
		t.Skip("haproxy not installed")
	}
	t.Setenv("LEASEHOLD_DATABASE_URL", "")
}
