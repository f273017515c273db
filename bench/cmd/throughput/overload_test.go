package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/bench/internal/fleet"
	"github.com/leasehold/leasehold/bench/internal/harness"
)

// TestRecoveredAfter: the first second from which every later second's
// p99 is under the bound; -1 when the last second is not.
func TestRecoveredAfter(t *testing.T) {
	for _, c := range []struct {
		p99s []float64
		want float64
	}{
		{nil, -1},
		{[]float64{0.1, 0.2}, 0},
		{[]float64{3, 1, 0.4, 0.2}, 2},
		{[]float64{3, 0.1, 0.7, 0.2, 0.3}, 3},
		{[]float64{0.1, 0.2, 0.9}, -1},
	} {
		require.Equal(t, c.want, recoveredAfter(c.p99s), "%v", c.p99s)
	}
}

// TestOverloadSmoke runs the overload scenario briefly through the api
// (20 nodes, a paced first run as the maximum, 6 s at twice it, 2 s at
// half): it must attempt and admit creates, complete commands during the
// overload, sample the gateways' overload every second and read the p99 of
// the recovery per second. Figures are not asserted: a busy machine moves
// them.
func TestOverloadSmoke(t *testing.T) {
	skipWithoutProcesses(t)
	c := config{nodes: 20, gateways: []int{1}, concurrency: 4, rate: 100,
		warmup: time.Second, window: 2 * time.Second, drain: time.Minute, producer: "api", nodesProcess: true,
		overload: true, overloadFactor: 2, overloadFor: overloadWarmup + time.Second, recoverFor: 2 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	sup := &harness.Supervisor{}
	defer sup.Stop()
	res, err := run(ctx, c, sup, func(*fleet.Fleet) {})
	require.NoError(t, err)
	o := res.Overload
	require.NotNil(t, o)
	require.Equal(t, "api", o.Producer)
	require.Positive(t, o.MaxPS)
	require.InDelta(t, 2*o.MaxPS, o.OfferedPS, 1e-9)
	require.Positive(t, o.AttemptedPS)
	require.Positive(t, o.AdmittedPS)
	require.InDelta(t, o.AttemptedPS, o.AdmittedPS+o.RefusedPS, 1, "every attempt was admitted or refused")
	require.Positive(t, o.CompletedPS)
	require.GreaterOrEqual(t, o.RecoverSeconds, -1.0)
	t.Logf("max %.0f/s; overload: %.0f attempted/s, %.0f admitted/s, %.0f refused/s, %.0f completed/s; recovered after %.0f s",
		o.MaxPS, o.AttemptedPS, o.AdmittedPS, o.RefusedPS, o.CompletedPS, o.RecoverSeconds)
}
