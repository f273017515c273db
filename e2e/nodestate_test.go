package e2e

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/daemon"
	"github.com/leasehold/leasehold/pkg/faultproxy"
	"github.com/leasehold/leasehold/pkg/fleettest"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestNodeNeverUnreachableWhileConnectedElsewhere kills, at once, the worker
// holding a node's shard and the gateway holding the node's session. The
// node redials through the balancer to the other gateway; the surviving
// worker takes the shard over and reconciles. The node must never be marked
// unreachable while it has a live session, and ends connected.
func TestNodeNeverUnreachableWhileConnectedElsewhere(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	db := pgtest.NewDB(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	g1 := fleettest.StartGateway(t, db.URL, "gw_one", fleettest.FastGateway...)
	g2 := fleettest.StartGateway(t, db.URL, "gw_two", fleettest.FastGateway...)
	// A short grace so that a wrong transition would happen within the test.
	workerArgs := append([]string{"--nodes.gateway-loss-grace", "1s", "--nodes.scan-interval", "200ms"}, fleettest.FastCoord...)
	workers := map[string]interface{ Kill() }{
		"w1": fleettest.StartService(t, "worker", db.URL, "w1", workerArgs...),
		"w2": fleettest.StartService(t, "worker", db.URL, "w2", workerArgs...),
	}
	lb, err := faultproxy.NewBalancer(g1.Listen, g2.Listen)
	require.NoError(t, err)
	defer lb.Close()

	ids, creds := fleettest.RegisterNodes(t, db.Pool, "node", 20)
	var wg sync.WaitGroup
	for i := range ids {
		d, err := daemon.New(daemon.Config{Address: lb.URL(), NodeID: ids[i], Credential: creds[i],
			BackoffBase: 200 * time.Millisecond, BackoffMax: time.Second,
			Handler: func(context.Context, *nodev1.Command) daemon.Outcome { return daemon.Outcome{} }})
		require.NoError(t, err)
		wg.Add(1)
		go func() { defer wg.Done(); _ = d.Run(ctx) }()
	}
	defer func() { cancel(); wg.Wait() }()
	connected := func(gw string) int {
		var n int
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM node_sessions s JOIN nodes n ON n.id = s.node_id
			WHERE s.state = 'connected' AND n.state = 'connected' AND s.gateway_id = $1`, gw).Scan(&n))
		return n
	}
	require.Eventually(t, func() bool { return connected("gw_one") == len(ids) }, 30*time.Second, 50*time.Millisecond)

	// The worker holding node-0's shard, and node-0's gateway, die together.
	var holder string
	require.Eventually(t, func() bool {
		err := db.Pool.QueryRow(ctx, "SELECT owner FROM leases WHERE name = $1 AND expires_at > compute_now()",
			coord.Controllers.ShardLease(coord.ShardOf(ids[0]))).Scan(&holder)
		return err == nil && holder != ""
	}, 20*time.Second, 50*time.Millisecond)
	workers[holder].Kill()
	g1.Kill()

	// Sample the invariant while everything settles.
	deadline := time.Now().Add(12 * time.Second)
	for time.Now().Before(deadline) {
		var bad int
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM nodes n JOIN node_sessions s ON s.node_id = n.id
			LEFT JOIN leases l ON l.name = 'gateway:' || s.gateway_id
			WHERE n.state = 'unreachable' AND s.state = 'connected' AND l.expires_at > compute_now()`).Scan(&bad))
		require.Zero(t, bad, "a node was marked unreachable while it had a live session")
		time.Sleep(50 * time.Millisecond) // sampling interval of an invariant checked throughout the takeover
	}
	require.Eventually(t, func() bool { return connected("gw_two") == len(ids) }, 20*time.Second, 50*time.Millisecond)
	var unreachable int
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT count(*) FROM nodes WHERE state = 'unreachable'").Scan(&unreachable))
	require.Zero(t, unreachable)
	var events int
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT count(*) FROM node_events WHERE kind = 'node.unreachable'").Scan(&events))
	require.Zero(t, events)
}
