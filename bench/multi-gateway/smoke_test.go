package main

import (
	"context"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/bench/internal/fleet"
	"github.com/leasehold/leasehold/pkg/clock"
)

// TestGateSmoke runs the whole simulator briefly, twice: 30 nodes with the
// fast timings and one gateway paused 5 s, then 30 nodes with the
// production durations on a clock scaled 10x and one gateway killed. Each
// gate must pass: nothing lost or duplicated, every node re-homed, and the
// zombie fences itself (exit 1) and writes nothing.
func TestGateSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	if os.Getenv("LEASEHOLD_TEST_PGBOUNCER") != "" {
		t.Skip("runs its own PostgreSQL: nothing to learn through PgBouncer")
	}
	if _, err := exec.LookPath("haproxy"); err != nil {
		t.Skip("haproxy not installed")
	}
	t.Setenv("LEASEHOLD_DATABASE_URL", "") // a throwaway local cluster, never a pooler
	base := config{producer: "sql", nodes: 30, gateways: 3, rate: 20, helloRate: 200, maxWait: time.Minute,
		settle: 30 * time.Second, drainDelay: time.Second, lossGrace: time.Second, durable: false}
	zombie := base
	zombie.scenario, zombie.timings, zombie.warmup, zombie.observe, zombie.pause = "zombie", "fast", 3*time.Second, 8*time.Second, 5*time.Second
	scaled := base
	scaled.scenario, scaled.timings, scaled.warmup, scaled.observe = "kill", "real", 20*time.Second, 20*time.Second
	scaled.lossGrace = 20 * time.Second
	scaled.scale = clock.Scale{Epoch: time.Now(), Rate: 10}
	for name, c := range map[string]config{"zombie-fast": zombie, "kill-scaled-x10": scaled} {
		t.Run(name, func(t *testing.T) {
			require.NoError(t, c.validate())
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			res, err := run(ctx, c, func(*fleet.Fleet) {})
			require.NoError(t, err)
			require.True(t, res.Gate.Pass, "gate: %+v", res.Gate)
			require.Equal(t, res.NodesLost, res.Rehomed)
			require.Positive(t, res.CommandsCreated)
			t.Logf("%s (%s): recovery %s (simulated seconds when scaled)", c.scenario, res.Timings, res.Recovery)
		})
	}
}
