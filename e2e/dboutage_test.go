package e2e

import (
	"context"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/fleettest"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// outageLength is how long TestDatabaseOutageRecoversInPlace keeps
// PostgreSQL stopped: 45 s, far past every TTL (gateway 2 s, coord 3 s), or
// LEASEHOLD_TEST_OUTAGE (e.g. 5m for the long run in docs/reliability.md).
func outageLength(t *testing.T) time.Duration {
	if s := os.Getenv("LEASEHOLD_TEST_OUTAGE"); s != "" {
		d, err := time.ParseDuration(s)
		require.NoError(t, err, "LEASEHOLD_TEST_OUTAGE")
		return d
	}
	return 45 * time.Second
}

type probed interface {
	Exited() bool
	WaitReady(time.Duration)
	Logs() string
	Get(path, token string) (int, string, error)
}

// TestDatabaseOutageRecoversInPlace stops PostgreSQL for 45 s under load
// (two gateways, two workers, a scheduler, 20 node daemons, a command every
// 20 ms) and starts it again. During the outage no /livez fails (a restart
// cannot fix the database), every process answers not ready, the gateways
// fence themselves and stay up. Afterwards every process is ready again
// without a restart, the workers hold all 256 controller shards between
// them, each gateway serves at a new epoch, and every command created
// executes exactly once on its node; nothing acknowledged is lost.
func TestDatabaseOutageRecoversInPlace(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes and a long database outage")
	}
	if os.Getenv("LEASEHOLD_GATEWAY_HTTP2_SERVER") == "std" {
		t.Skip("the HTTP/2 server plays no part in a database outage: runs in the default and PgBouncer modes")
	}
	outage := outageLength(t)
	srv := pgtest.Server(t)
	db := pgtest.NewDB(t)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `ALTER DATABASE `+pgx.Identifier{db.Name}.Sanitize()+` SET synchronous_commit = on`)
	require.NoError(t, err)

	coordArgs := slices.Clone(fleettest.FastCoord)
	g1 := fleettest.StartGateway(t, db.URL, "gw_o1", fleettest.FastGateway...)
	g2 := fleettest.StartGateway(t, db.URL, "gw_o2", fleettest.FastGateway...)
	w1 := fleettest.StartService(t, "worker", db.URL, "wo1", coordArgs...)
	w2 := fleettest.StartService(t, "worker", db.URL, "wo2", coordArgs...)
	s1 := fleettest.StartService(t, "scheduler", db.URL, "so1", coordArgs...)
	procs := map[string]probed{"gw_o1": g1, "gw_o2": g2, "wo1": w1, "wo2": w2, "so1": s1}
	lb := balancer(t, g1.Listen, g2.Listen)

	ids, creds := fleettest.RegisterNodes(t, db.Pool, "onode", 20)
	// The daemons' production back-off (1 s doubling to 60 s): what the
	// outage grows, and what a gateway's pushback must reset.
	nodes := startNodesBackoff(t, lb.URL(), ids, creds, time.Second, time.Minute)
	require.Eventually(t, func() bool {
		n, err := queryInt(db.Pool, `SELECT count(*) FROM node_sessions WHERE state = 'connected'`)
		return err == nil && n == len(ids)
	}, 30*time.Second, 50*time.Millisecond)
	require.Eventually(t, func() bool {
		n, err := queryInt(db.Pool, `SELECT count(*) FROM leases WHERE name LIKE 'shard:%' AND owner IS NOT NULL AND expires_at > compute_now()`)
		return err == nil && n == 256
	}, 30*time.Second, 50*time.Millisecond, "the workers hold every controller shard before the outage")
	load := startLoad(t, db.Pool, "ocmd", ids, 20*time.Millisecond)
	require.Eventually(t, func() bool {
		n, err := queryInt(db.Pool, `SELECT count(*) FROM command_results_all`)
		return err == nil && n >= 50
	}, 30*time.Second, 50*time.Millisecond)
	before := readLeases(t, db.Pool)

	// Probe every process once a second for the whole outage.
	var (
		mu        sync.Mutex
		liveFails []string
		notReady  = map[string]bool{}
		fenced    = map[string]bool{} // gateways whose leasehold_role read 2
	)
	probe := func() {
		for name, p := range procs {
			if code, body, err := p.Get("/livez", ""); err != nil || code != 200 {
				mu.Lock()
				liveFails = append(liveFails, name+": "+strings.TrimSpace(body))
				mu.Unlock()
			}
			if code, _, err := p.Get("/readyz", ""); err == nil && code == 503 {
				mu.Lock()
				notReady[name] = true
				mu.Unlock()
			}
			if strings.HasPrefix(name, "gw_") && metricValue(t, p, `leasehold_role{component="gateway"}`) == 2 {
				mu.Lock()
				fenced[name] = true
				mu.Unlock()
			}
		}
	}
	stopProbe := make(chan struct{})
	probed := make(chan struct{})
	go func() {
		defer close(probed)
		for {
			select {
			case <-stopProbe:
				return
			case <-time.After(time.Second):
				probe()
			}
		}
	}()

	srv.Stop(t)
	stoppedAt := time.Now()
	for time.Since(stoppedAt) < outage {
		for name, p := range procs {
			require.False(t, p.Exited(), "%s exited during the outage\n%s", name, p.Logs())
		}
		time.Sleep(500 * time.Millisecond) // sampling through the outage (the fault) that no process exits
	}
	welcomesBefore := make([]int64, len(nodes.daemons))
	for i, d := range nodes.daemons {
		welcomesBefore[i] = d.Stats().Welcomes
	}
	srv.Start(t)
	back := time.Now()
	// When every node holds a new session, measured from the database's
	// return by a poller that starts now.
	nodesBackAt := make(chan time.Duration, 1)
	go func() {
		for time.Since(back) < 2*time.Minute {
			all := true
			for i, d := range nodes.daemons {
				if d.Welcome() == nil || d.Stats().Welcomes <= welcomesBefore[i] {
					all = false
					break
				}
			}
			if all {
				nodesBackAt <- time.Since(back)
				return
			}
			time.Sleep(20 * time.Millisecond) // polling the daemons' counters
		}
		nodesBackAt <- -1
	}()

	for name, p := range procs {
		p.WaitReady(2 * time.Minute)
		require.False(t, p.Exited(), "%s exited: it must recover in-process\n%s", name, p.Logs())
	}
	readyAfter := time.Since(back)
	nodesBack := <-nodesBackAt
	require.GreaterOrEqual(t, nodesBack, time.Duration(0), "every node has a new session within 2 minutes")
	// The gateways push Hellos back for 1-3 s while fenced, which resets
	// the nodes' back-off: they return within seconds of the gateways
	// serving, not after a back-off the outage grew towards a minute. The
	// bound is loose for a loaded machine; the figure is logged.
	require.Less(t, nodesBack, 20*time.Second, "nodes returned %s after the database did", nodesBack)
	require.Eventually(t, func() bool {
		n, err := queryInt(db.Pool, `SELECT count(*) FROM leases WHERE name LIKE 'shard:%' AND owner IN ('wo1', 'wo2') AND expires_at > compute_now()`)
		return err == nil && n == 256
	}, time.Minute, 50*time.Millisecond, "the workers hold every controller shard again")
	heldAfter := time.Since(back)
	close(stopProbe)
	<-probed

	mu.Lock()
	require.Empty(t, liveFails, "/livez never fails because of the database")
	for _, name := range []string{"gw_o1", "gw_o2", "wo1", "wo2"} {
		require.True(t, notReady[name], "%s answered not ready while the database was away", name)
	}
	for _, gw := range []string{"gw_o1", "gw_o2"} {
		require.True(t, fenced[gw], "%s exported leasehold_role 2 (fenced) while the database was away", gw)
	}
	mu.Unlock()
	// The role and lease metrics say the same as the database once it is
	// back: both gateways active, the workers' shard gauges adding up to
	// every controller shard.
	require.Eventually(t, func() bool {
		for _, gw := range []string{"gw_o1", "gw_o2"} {
			if metricValue(t, procs[gw], `leasehold_role{component="gateway"}`) != 1 {
				return false
			}
		}
		return metricValue(t, w1, `leasehold_shards_owned{group="controllers"}`)+metricValue(t, w2, `leasehold_shards_owned{group="controllers"}`) == 256
	}, time.Minute, 100*time.Millisecond, "gateways export leasehold_role 1 and the workers' leasehold_shards_owned add up to 256")
	after := readLeases(t, db.Pool)
	for _, gw := range []string{"gw_o1", "gw_o2"} {
		name := "gateway:" + gw
		require.Equal(t, gw, after[name].owner)
		require.Greater(t, after[name].epoch, before[name].epoch, "%s serves again at a new epoch", name)
		require.Contains(t, procs[gw].Logs(), "gateway serving again")
	}
	for name, b := range before {
		require.GreaterOrEqual(t, after[name].epoch, b.epoch, "epoch of %s went backwards", name)
	}

	created, acked, failed := load.created(t)
	waitCompleted(t, db.Pool, nodes, created, 2*time.Minute)
	for _, id := range created {
		require.Equal(t, 1, nodes.executed(id), "command %s executions", id)
	}
	dup, distinct := nodes.twice()
	require.Empty(t, dup, "commands executed twice")
	require.Equal(t, len(created), distinct)
	t.Logf("outage %s: every process ready %s after the database was back, every node's session back %s after the database, all 256 shards held after %s; "+
		"%d commands (%d acknowledged, %d failed inserts), each executed exactly once; 0 restarts",
		outage, readyAfter.Round(time.Millisecond), nodesBack.Round(time.Millisecond), heldAfter.Round(time.Millisecond), len(created), acked, failed)
}
