package reconcile_test

import (
	"context"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/faultproxy"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// heldBy returns the leases owner holds now with their database expiry.
func heldBy(t *testing.T, f failover, owner string) map[string]time.Time {
	t.Helper()
	rows, err := f.db.Pool.Query(context.Background(), `SELECT name, expires_at FROM leases WHERE owner = $1 AND expires_at > compute_now()`, owner)
	require.NoError(t, err)
	defer rows.Close()
	out := map[string]time.Time{}
	for rows.Next() {
		var name string
		var exp time.Time
		require.NoError(t, rows.Scan(&name, &exp))
		out[name] = exp
	}
	require.NoError(t, rows.Err())
	return out
}

// takenBefore counts the leases of before (name -> expiry as the victim held
// it) that owner acquired before that expiry.
func takenBefore(t *testing.T, f failover, owner string, before map[string]time.Time) int {
	t.Helper()
	n := 0
	for name, exp := range before {
		var acquired *time.Time
		err := f.db.Pool.QueryRow(context.Background(), `SELECT acquired_at FROM leases WHERE name = $1 AND owner = $2`, name, owner).Scan(&acquired)
		if err == nil && acquired != nil && acquired.Before(exp) {
			n++
		}
	}
	return n
}

func needLiveness(t *testing.T) {
	t.Helper()
	if !pgtest.NotifyAvailable() {
		t.Skip("no direct database URL in this pgtest mode: liveness sessions are off and the TTL path alone applies")
	}
}

// TestLivenessTakesOverAKilledMemberBeforeItsLeasesExpire: with default
// timings (TTL 15 s), SIGKILL a worker holding every lease. Its liveness
// session ends with it, so the survivor releases its leases after the
// self-fence deadline and a margin and takes all of them long before they
// would have expired; no key ran on both.
func TestLivenessTakesOverAKilledMemberBeforeItsLeasesExpire(t *testing.T) {
	t.Parallel()
	needLiveness(t)
	f := setupFailover(t)
	a := f.start(t, "wa", f.db.URL)
	f.waitHeld(t, "wa", allLeases, 30*time.Second)
	b := f.start(t, "wb", f.db.URL)
	stop := f.enqueue(t)
	require.Eventually(t, func() bool { return strings.Contains(a.Logs(), "liveness session up") }, 10*time.Second, 20*time.Millisecond)
	time.Sleep(time.Second) // let A renew and reconcile: the kill lands mid-work

	victim := heldBy(t, f, "wa")
	a.Kill()
	took := f.waitHeld(t, "wb", allLeases, 20*time.Second)
	t.Logf("crash (SIGKILL) with a liveness session: B held all %d leases %s after the kill (TTL 15 s)", allLeases, took.Round(time.Millisecond))
	require.Equal(t, len(victim), takenBefore(t, f, "wb", victim), "every lease of the dead member was taken before it would have expired")
	require.Contains(t, b.Logs(), "member's liveness session is gone")
	stop()
	f.drained(t)
	require.Zero(t, f.overlaps(t), "no key ran on both workers at once")
}

// TestLivenessLeavesAPausedMemberToTheTTL: SIGSTOP a member for longer than
// the self-fence deadline (1.5 s) but less than the TTL (3 s). Its session
// stays open, so nobody takes anything before it expires; on resume it
// commits nothing after a takeover.
func TestLivenessLeavesAPausedMemberToTheTTL(t *testing.T) {
	t.Parallel()
	needLiveness(t)
	f := setupFailover(t)
	// Self-release after 10 s: a 2.5 s pause must be seen by the TTL and
	// the liveness rules, not by the stall watchdog (fastArgs: 2 s).
	a := f.start(t, "wa", f.db.URL, append(slices.Clone(fastArgs), "--work", "100ms", "--coord.self-release-after", "10s")...)
	f.waitHeld(t, "wa", allLeases, 30*time.Second)
	b := f.start(t, "wb", f.db.URL, fastArgs...)
	require.Eventually(t, func() bool { return f.held(t, "wb") >= 50 && f.held(t, "wa") >= 50 }, 20*time.Second, 20*time.Millisecond)
	stop := f.enqueue(t)
	require.Eventually(t, func() bool {
		return count(t, f.db.Pool, "SELECT count(*) FROM reconcile_log WHERE owner = $1", "wa") >= 10
	}, 30*time.Second, 20*time.Millisecond, "wa reconciles under load")

	a.Pause()
	victim := heldBy(t, f, "wa")
	time.Sleep(2500 * time.Millisecond) // the fault: a pause past D, short of the TTL
	var resumed time.Time
	require.NoError(t, f.db.Pool.QueryRow(context.Background(), "SELECT compute_now()").Scan(&resumed))
	a.Resume()
	time.Sleep(3 * time.Second) // a window for the resumed A to go on: what is checked is that nothing was taken from it early
	stop()
	f.drained(t)
	require.Zero(t, takenBefore(t, f, "wb", victim), "nothing of a paused member is taken before it expires")
	require.NotContains(t, b.Logs(), "member's liveness session is gone", "a paused member's session stays: no liveness takeover")
	require.Zero(t, f.overlaps(t))
}

// TestLivenessMemberCutOffFromTheDatabase: every connection of a running
// member (pool, LISTEN and liveness session) goes through a proxy that is
// then cut and refuses: the server sees its sessions end while the process
// keeps running. The member stops trusting its leases within the self-fence
// deadline, the survivor takes them before they expire, and no write of the
// member commits after the takeover.
func TestLivenessMemberCutOffFromTheDatabase(t *testing.T) {
	t.Parallel()
	needLiveness(t)
	f := setupFailover(t)
	f.installChaosSchema(t)

	u, err := url.Parse(f.db.URL)
	require.NoError(t, err)
	proxy, err := faultproxy.New(u.Host)
	require.NoError(t, err)
	defer proxy.Close()
	via := *u
	via.Host = proxy.Addr()
	// Default timings (TTL 15 s): the liveness path must beat the expiry
	// by far, not by a fraction of a short test TTL.
	args := []string{"--work", "50ms"}
	a := f.start(t, "wa", via.String(), append(slices.Clone(args), "--listen-database-url", via.String())...)
	f.waitHeld(t, "wa", allLeases, 30*time.Second)
	b := f.start(t, "wb", f.db.URL, args...)
	require.Eventually(t, func() bool { return f.held(t, "wb") >= 50 && f.held(t, "wa") >= 50 }, 20*time.Second, 20*time.Millisecond)
	stop := f.enqueue(t)
	require.Eventually(t, func() bool {
		return count(t, f.db.Pool, "SELECT count(*) FROM reconcile_log WHERE owner = $1", "wa") >= 10
	}, 30*time.Second, 20*time.Millisecond, "wa reconciles under load")

	victim := heldBy(t, f, "wa")
	proxy.Refuse()
	proxy.CutAll()
	took := f.waitHeld(t, "wb", allLeases, 20*time.Second)
	t.Logf("member cut off with a liveness session: B held all %d leases %s after the cut (TTL 15 s)", allLeases, took.Round(time.Millisecond))
	require.Equal(t, len(victim), takenBefore(t, f, "wb", victim), "the survivor took every lease before it expired")
	require.Contains(t, b.Logs(), "member's liveness session is gone")
	stop()
	f.drained(t)
	require.Zero(t, count(t, f.db.Pool, `SELECT count(*) FROM reconcile_log r JOIN leases l ON l.name = r.lease
		WHERE r.owner = 'wa' AND l.owner = 'wb' AND r.finished_at >= l.acquired_at`), "no write of the cut-off member after the takeover")
	for _, inv := range chaosInvariants[:5] {
		require.Zero(t, count(t, f.db.Pool, inv.violations), inv.name)
	}
	require.False(t, a.Exited())
}
