package e2e

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/fleettest"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestNetworkFaultsBetweenDaemonsAndGateways puts a fault-injecting L4
// balancer between 20 node daemons and two gateway processes while commands
// are inserted every 20 ms: latency (100 ms per chunk each way), drops
// (every stream cut at once, twice), refusal (new dials refused for 2 s) and
// a blackhole (streams stay open, nothing passes, no RST: daemons must
// detect the silent gateway by heartbeat and redial) for 6 s. After healing,
// every command created completes, and each executed exactly once on its
// node: replays after redials are deduplicated by the daemons' journals.
func TestNetworkFaultsBetweenDaemonsAndGateways(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	db := pgtest.NewDB(t)
	g1 := fleettest.StartGateway(t, db.URL, "gw_n1", fleettest.FastGateway...)
	g2 := fleettest.StartGateway(t, db.URL, "gw_n2", fleettest.FastGateway...)
	lb := balancer(t, g1.Listen, g2.Listen)
	ids, creds := fleettest.RegisterNodes(t, db.Pool, "nnode", 20)
	nodes := startNodes(t, lb.URL(), ids, creds)
	connected := func() int {
		n, _ := queryInt(db.Pool, `SELECT count(*) FROM node_sessions WHERE state = 'connected'`)
		return n
	}
	require.Eventually(t, func() bool { return connected() == len(ids) }, 30*time.Second, 50*time.Millisecond)
	load := startLoad(t, db.Pool, "ncmd", ids, 20*time.Millisecond)
	results := func() int { n, _ := queryInt(db.Pool, `SELECT count(*) FROM command_results_all`); return n }

	lb.SetLatency(100 * time.Millisecond)
	time.Sleep(3 * time.Second) // the fault: 100 ms of latency for 3 s
	lb.SetLatency(0)
	for range 2 {
		lb.CutAll()
		time.Sleep(time.Second) // the fault: connections cut once a second
	}
	lb.Refuse()
	lb.CutAll()
	time.Sleep(2 * time.Second) // the fault: connections refused for 2 s
	lb.Restore()
	before := results()
	require.Eventually(t, func() bool { return results() > before }, 20*time.Second, 50*time.Millisecond, "results flow after drops")

	lb.Blackhole()
	time.Sleep(6 * time.Second) // the fault: a 6 s blackhole
	lb.Restore()
	start := time.Now()
	before = results()
	require.Eventually(t, func() bool { return results() > before }, 30*time.Second, 50*time.Millisecond, "results flow after the blackhole")
	t.Logf("first result %s after the blackhole healed", time.Since(start).Round(time.Millisecond))

	created, acked, failed := load.created(t)
	waitCompleted(t, db.Pool, nodes, created, 60*time.Second)
	dup, distinct := nodes.twice()
	require.Empty(t, dup, "commands executed twice")
	require.Equal(t, len(created), distinct)
	var redispatched int
	redispatched, err := queryInt(db.Pool, `SELECT count(*) FROM commands WHERE dispatch_count > 1`)
	require.NoError(t, err)
	t.Logf("daemon↔gateway faults: %d commands (%d acknowledged inserts, %d failed), %d dispatched more than once, each executed exactly once",
		len(created), acked, failed, redispatched)
	require.False(t, g1.Exited())
	require.False(t, g2.Exited())
}
