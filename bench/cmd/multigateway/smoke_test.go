package main

import (
	"context"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/leasehold/leasehold/bench/internal/fleet"
)

// TestZombieGateSmoke runs the whole simulator briefly with the fast
// timings: 30 nodes, one gateway paused 5 s. The gate must pass: the zombie
// fences itself (exit 1) and writes nothing, nothing is lost or duplicated.
func TestZombieGateSmoke(t *testing.T) {
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
	c := config{scenario: "zombie", producer: "sql", timings: "fast", nodes: 30, gateways: 3, rate: 20, helloRate: 200,
		warmup: 3 * time.Second, observe: 8 * time.Second, maxWait: time.Minute, settle: 30 * time.Second,
		pause: 5 * time.Second, drainDelay: time.Second, lossGrace: time.Second, durable: false}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	res, err := run(ctx, c, func(*fleet.Fleet) {})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Gate.Pass || res.Rehomed != res.NodesLost || res.CommandsCreated == 0 {
		t.Fatalf("gate: %+v (re-homed %d of %d, created %d)", res.Gate, res.Rehomed, res.NodesLost, res.CommandsCreated)
	}
	t.Logf("zombie (fast timings): recovery %s, zombie %+v", res.Recovery, *res.Zombie)
}
