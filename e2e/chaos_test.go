package e2e

import (
	"context"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/fleettest"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestChaosGatewaysAndDatabase is the randomized fault run with the
// gateways and the database in the mix: three gateways behind a balancer,
// two workers, 20 node daemons and a command every 20 ms, while a seeded
// schedule SIGKILLs gateways (started again on the same address after
// 0.5-3 s), pauses them (SIGSTOP for 0.2-4 s, past their 2 s lease TTL half
// the time), restarts PostgreSQL (fast or immediate) and stops it for 1-5 s.
// One gateway is always left running. Then everything heals and the run
// checks: every command created executed exactly once on its node, nothing
// acknowledged was lost, no (lease, epoch) was seen with two owners, and no
// worker exited. LEASEHOLD_CHAOS_DURATION (30 s) and LEASEHOLD_CHAOS_SEED
// as in pkg/reconcile's chaos run.
func TestChaosGatewaysAndDatabase(t *testing.T) {
	if testing.Short() {
		t.Skip("randomized real-process fault run")
	}
	if os.Getenv("LEASEHOLD_GATEWAY_HTTP2_SERVER") == "std" {
		t.Skip("runs in the default and PgBouncer modes")
	}
	duration := 30 * time.Second
	if v := os.Getenv("LEASEHOLD_CHAOS_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		require.NoError(t, err)
		duration = d
	}
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("LEASEHOLD_CHAOS_SEED"); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		require.NoError(t, err)
		seed = s
	}
	t.Logf("chaos: duration %s, seed %d", duration, seed)
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))

	srv := pgtest.Server(t)
	db := pgtest.NewDB(t)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `ALTER DATABASE `+pgx.Identifier{db.Name}.Sanitize()+` SET synchronous_commit = on`)
	require.NoError(t, err)

	names := []string{"gw_c1", "gw_c2", "gw_c3"}
	gws := map[string]fleettest.Gateway{}
	var addrs []string
	for _, n := range names {
		gws[n] = fleettest.StartGateway(t, db.URL, n, fleettest.FastGateway...)
		addrs = append(addrs, gws[n].Listen)
	}
	w1 := fleettest.StartService(t, "worker", db.URL, "wc1", fleettest.FastCoord...)
	w2 := fleettest.StartService(t, "worker", db.URL, "wc2", fleettest.FastCoord...)
	lb := balancer(t, addrs...)
	ids, creds := fleettest.RegisterNodes(t, db.Pool, "cnode", 20)
	nodes := startNodes(t, lb.URL(), ids, creds)
	require.Eventually(t, func() bool {
		n, err := queryInt(db.Pool, `SELECT count(*) FROM node_sessions WHERE state = 'connected'`)
		return err == nil && n == len(ids)
	}, 30*time.Second, 50*time.Millisecond)
	holders := fleettest.WatchHolders(db.Pool)
	load := startLoad(t, db.Pool, "ccmd", ids, 20*time.Millisecond)

	down := map[string]time.Time{}   // gateway -> start again at
	paused := map[string]time.Time{} // gateway -> resume at
	faults := map[string]int{}
	restart := func(n string) {
		gws[n] = fleettest.StartGateway(t, db.URL, n, append(fleettest.FastGateway, "--listen-addr", gws[n].Listen)...)
	}
	deadline := time.Now().Add(duration)
	for time.Now().Before(deadline) {
		time.Sleep(time.Duration(500+rng.IntN(1500)) * time.Millisecond) // the schedule: the next fault in 0.5-2 s
		now := time.Now()
		for n, at := range paused {
			if now.After(at) {
				gws[n].Resume()
				delete(paused, n)
				faults["resume"]++
			}
		}
		for n, at := range down {
			if now.After(at) {
				restart(n)
				delete(down, n)
				faults["start"]++
			}
		}
		var up []string
		for _, n := range names {
			if _, d := down[n]; !d {
				if _, p := paused[n]; !p {
					up = append(up, n)
				}
			}
		}
		switch action := rng.IntN(4); {
		case action == 0 && len(up) > 1:
			n := up[rng.IntN(len(up))]
			gws[n].Kill()
			down[n] = now.Add(time.Duration(500+rng.IntN(2500)) * time.Millisecond)
			faults["gateway-kill"]++
		case action == 1 && len(up) > 1:
			n := up[rng.IntN(len(up))]
			gws[n].Pause()
			paused[n] = now.Add(time.Duration(200+rng.IntN(3800)) * time.Millisecond)
			faults["gateway-pause"]++
		case action == 2:
			srv.Restart(t, rng.IntN(2) == 1)
			faults["db-restart"]++
		case action == 3:
			srv.Stop(t)
			time.Sleep(time.Duration(1000+rng.IntN(4000)) * time.Millisecond) // the fault: a 1-5 s outage
			srv.Start(t)
			faults["db-outage"]++
		}
		require.False(t, w1.Exited() || w2.Exited(), "a worker exited\n%s\n%s", w1.Logs(), w2.Logs())
	}
	for n := range paused {
		gws[n].Resume()
	}
	for n := range down {
		restart(n)
	}
	for n, g := range gws {
		require.False(t, g.Exited(), "%s exited: a fenced gateway stays up\n%s", n, g.Logs())
		g.WaitReady(2 * time.Minute)
	}

	created, acked, failed := load.created(t)
	waitCompleted(t, db.Pool, nodes, created, 2*time.Minute)
	for _, id := range created {
		require.Equal(t, 1, nodes.executed(id), "command %s executions", id)
	}
	dup, _ := nodes.twice()
	require.Empty(t, dup, "commands executed twice")
	bad, pairs := holders.Stop()
	require.Empty(t, bad, "two owners at one epoch of one lease")
	injected := faults["gateway-kill"] + faults["gateway-pause"] + faults["db-restart"] + faults["db-outage"]
	require.Greater(t, injected, 3, "the run injected faults")
	t.Logf("chaos: %d faults (gateway kill %d, gateway pause %d, database restart %d, database outage %d); "+
		"%d commands (%d acknowledged, %d failed inserts) each executed exactly once; %d (lease, epoch) pairs seen, 0 with two owners; 0 violations (seed %d)",
		injected, faults["gateway-kill"], faults["gateway-pause"], faults["db-restart"], faults["db-outage"],
		len(created), acked, failed, pairs, seed)
}
