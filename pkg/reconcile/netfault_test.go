package reconcile_test

import (
	"context"
	"net/url"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/faultproxy"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestNetworkFaultsBetweenWorkerAndDatabase puts a fault-injecting TCP proxy
// between worker A (every connection, LISTEN included) and PostgreSQL while
// worker B reaches it directly and keys are enqueued throughout:
//
//  1. latency: 40 ms each way on every chunk for 4 s (A keeps working;
//     statement timeouts are 1 s here);
//  2. drops: every connection of A cut at once, twice (A redials, keeps or
//     retakes its leases);
//  3. refuse: new connections refused for 1.5 s after a cut (a host down);
//  4. blackhole: A's connections stay open but nothing passes (half-open,
//     no RST). A must stop acting within its leases' validity; B takes
//     every lease over after expiry;
//  5. heal: A comes back and rejoins — in-process, or, when its loops
//     stalled past --coord.self-release-after and /livez failed, through a
//     restart by its supervisor (emulated here).
//
// Every fenced write records, from inside its transaction, the epoch and the
// expiry of the lease it was fenced on (chaosSchema): the checker then
// proves no write of A committed after its lease's validity, no two epochs
// interleaved, and no key ran on both at once.
func TestNetworkFaultsBetweenWorkerAndDatabase(t *testing.T) {
	t.Parallel()
	f := setupFailover(t)
	f.installChaosSchema(t)

	u, err := url.Parse(f.db.URL)
	require.NoError(t, err)
	proxy, err := faultproxy.New(u.Host)
	require.NoError(t, err)
	defer proxy.Close()
	viaProxy := *u
	viaProxy.Host = proxy.Addr()
	args := append(slices.Clone(fastArgs), "--work", "20ms")
	// A's LISTEN goes through the proxy too (or, behind PgBouncer, A polls):
	// the whole host is cut off, not only its pool.
	// A loop stalled 5 s while the database answers would self-release;
	// being cut off must not count as a stall.
	aArgs := append(slices.Clone(args), "--coord.self-release-after", "5s")
	if pgtest.Pooled() {
		aArgs = append(aArgs, "--pooler")
	}
	a := f.start(t, "wa", viaProxy.String(), aArgs...)
	f.waitHeld(t, "wa", allLeases, 30*time.Second)
	f.start(t, "wb", f.db.URL, args...)
	require.Eventually(t, func() bool { return f.held(t, "wb") >= 50 && f.held(t, "wa") >= 50 }, 20*time.Second, 20*time.Millisecond,
		"the two split the shards")
	stop := f.enqueue(t)
	runs := func(owner string) int {
		return count(t, f.db.Pool, "SELECT count(*) FROM reconcile_log WHERE owner = $1", owner)
	}

	// 1. Latency.
	heldA := f.held(t, "wa")
	before := runs("wa")
	proxy.SetLatency(40 * time.Millisecond)
	time.Sleep(4 * time.Second) // the fault: 40 ms of latency for 4 s
	proxy.SetLatency(0)
	require.Greater(t, runs("wa"), before, "A keeps working under latency")
	t.Logf("latency 40 ms: A held %d leases before, %d after; %d runs under latency", heldA, f.held(t, "wa"), runs("wa")-before)

	// 2. Drops, and 3. refusal.
	for range 2 {
		proxy.CutAll()
		time.Sleep(500 * time.Millisecond) // the fault: connections cut twice a second
	}
	proxy.Refuse()
	proxy.CutAll()
	time.Sleep(1500 * time.Millisecond) // the fault: connections refused for 1.5 s
	proxy.Restore()
	before = runs("wa")
	require.Eventually(t, func() bool { return runs("wa") > before }, 15*time.Second, 50*time.Millisecond,
		"A works again after drops and refusal")
	require.False(t, a.Exited(), "A survives dropped and refused connections")

	// 4. Blackhole: half-open connections, no RST.
	require.Eventually(t, func() bool { return f.held(t, "wa") > 0 }, 15*time.Second, 20*time.Millisecond)
	var cut time.Time
	require.NoError(t, f.db.Pool.QueryRow(context.Background(), "SELECT compute_now()").Scan(&cut))
	proxy.Blackhole()
	took := f.waitHeld(t, "wb", allLeases, 15*time.Second)
	t.Logf("blackhole: B held all %d leases %s after A was cut off (TTL 3 s)", allLeases, took.Round(time.Millisecond))
	// A's last lease expiry as the database saw it: no write of A may
	// finish after it.
	var lastValid time.Time
	require.NoError(t, f.db.Pool.QueryRow(context.Background(),
		"SELECT coalesce(max(valid_at_finish), $1) FROM reconcile_log WHERE owner = 'wa'", cut).Scan(&lastValid))
	time.Sleep(2 * time.Second) // a window for the cut-off holder to try: what is checked is that nothing of it lands
	require.Zero(t, count(t, f.db.Pool, "SELECT count(*) FROM reconcile_log WHERE owner = 'wa' AND finished_at > $1", lastValid),
		"a write of the blackholed holder committed after its validity")

	// 5. Heal: A's stale connections are dropped by their own timeouts; it
	// rejoins and takes its share back in-process. Being cut off from the
	// database is an outage, not a stall: /livez stays 200 and nothing
	// needs a restart.
	proxy.Restore()
	proxy.CutAll()
	code, _, err := a.Get("/livez", "")
	require.NoError(t, err)
	require.Equal(t, 200, code, "/livez of a process cut off from its database stays 200")
	require.False(t, a.Exited())
	require.Eventually(t, func() bool { return f.held(t, "wa") > 0 }, 30*time.Second, 50*time.Millisecond, "A rejoins after the blackhole")
	t.Logf("heal: A rejoined in-process")
	stop()
	f.drained(t)

	violations := 0
	for _, inv := range chaosInvariants {
		if v := count(t, f.db.Pool, inv.violations); v > 0 {
			t.Errorf("invariant violated %d times: %s", v, inv.name)
			violations += v
		}
	}
	var late int
	require.NoError(t, f.db.Pool.QueryRow(context.Background(),
		`SELECT count(*) FROM reconcile_log WHERE owner = 'wa' AND finished_at > valid_at_finish`).Scan(&late))
	t.Logf("network faults: latency, 3 cuts, refusal, blackhole, heal survived; %d fenced writes checked, %d after validity, %d violations",
		count(t, f.db.Pool, "SELECT count(*) FROM reconcile_log"), late, violations)
	require.False(t, a.Exited())
}
