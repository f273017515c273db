package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/bench/internal/harness"
)

// TestNodeAgentSmoke runs the node agent bench briefly on its real stack (the
// api, two gateways with relays, two leasehold-node processes): a 2 s idle
// window, 2 + 10 `exec /bin/true` commands, and 2 MiB of output read live,
// once through the default 1 MiB gateway cap and once with the caps raised
// to 4 MiB. Each agent's footprint and runtime figures must be read, every
// measured exec must succeed with all its phases timed, and both outputs
// must reach the reader whole: past the default cap relayed by the gateway
// while PostgreSQL keeps the cap and its marker, with the caps raised all
// stored.
func TestNodeAgentSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	t.Setenv("LEASEHOLD_DATABASE_URL", "") // a throwaway local cluster: its CPU is read from /proc
	const outputBytes, bigCap = 2 << 20, 4 << 20
	c := config{idle: 2 * time.Second, idleSample: 250 * time.Millisecond, execs: 10, warmupExecs: 2,
		outputBytes: outputBytes, bigCap: bigCap, outputSource: "urandom",
		phases:       map[string]bool{"idle": true, "exec": true, "output": true},
		rssTargetMiB: 15, cpuTargetPct: 0.1, execTargetP50: 0.050, rateTargetMiB: 50}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	sup := &harness.Supervisor{}
	defer sup.Stop()
	res, err := run(ctx, c, sup)
	require.NoError(t, err)

	require.Len(t, res.Idle, 2)
	for _, i := range res.Idle {
		require.GreaterOrEqual(t, i.WindowS, c.idle.Seconds(), i.Agent)
		require.Positive(t, i.RSSMaxKiB, i.Agent)
		require.Positive(t, i.RSSLastKiB, i.Agent)
		require.Positive(t, i.Runtime["go_goroutines"], "%s: the agent's /metrics", i.Agent)
	}

	require.NotNil(t, res.Exec)
	require.Equal(t, c.execs, res.Exec.N)
	require.Equal(t, c.execs, res.Exec.Latency.N)
	for _, k := range execPhases {
		require.Equal(t, c.execs, res.Exec.Phases[k].N, k)
	}
	require.Positive(t, res.Exec.Statements)

	require.Len(t, res.Output, 2)
	capped, whole := res.Output[0], res.Output[1]
	for _, o := range res.Output {
		require.Equal(t, "COMMAND_STATE_SUCCEEDED", o.State, o.Label)
		require.Positive(t, o.Rows, o.Label)
	}
	require.EqualValues(t, 1<<20, capped.GatewayCap)
	require.EqualValues(t, outputBytes, capped.Received, "the reader gets the whole output, relayed past the gateway's cap")
	require.False(t, capped.Truncated)
	require.EqualValues(t, capped.GatewayCap, capped.RowBytes, "PostgreSQL keeps the cap")
	require.EqualValues(t, bigCap, whole.GatewayCap)
	require.EqualValues(t, outputBytes, whole.Received, "the reader gets the whole output")
	require.False(t, whole.Truncated)
	require.EqualValues(t, outputBytes, whole.RowBytes)
	t.Logf("idle RSS %.1f MiB; exec p50 %.1f ms; %.1f MiB/s to the reader past the cap, %.1f MiB/s with the caps raised",
		float64(res.Idle[0].RSSMaxKiB)/1024, res.Exec.Latency.P50*1000, capped.ReaderMiBps, whole.ReaderMiBps)
}
