package reconcile_test

import (
	"bufio"
	"context"
	"errors"
	"net/http"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/migrations"
	"github.com/leasehold/leasehold/pkg/netns"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// vanishSetup makes a namespace for the member that will vanish and a
// PostgreSQL cluster of the test's own that listens on the namespace's link
// as well as on loopback (the binary's shared server listens on loopback
// only, and a server's listen addresses are fixed at start). It returns the
// namespace and a migrated database on that cluster.
func vanishSetup(t *testing.T) (*netns.Namespace, *pgtest.DB) {
	t.Helper()
	if testing.Short() {
		t.Skip("real-time failover test")
	}
	if err := netns.Available(); err != nil {
		t.Skipf("vanished-host test: %v", err)
	}
	if pgtest.Mode() != pgtest.ModeDirect {
		t.Skip("vanished-host test: runs on its own direct server; the PgBouncer passes cover the TTL path")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ns, err := netns.New(ctx, 20+os.Getpid()%200)
	if err != nil {
		t.Skipf("vanished-host test: %v", err)
	}
	t.Cleanup(ns.Close)
	// The keep-alive connection that polled the member's /readyz across the
	// link never hears a FIN once it is cut: close it.
	t.Cleanup(http.DefaultClient.CloseIdleConnections)
	dir, err := os.MkdirTemp("", "leasehold-vanish-")
	require.NoError(t, err)
	c, err := pglocal.New(ctx, pglocal.Options{Dir: dir, Listen: []string{ns.HostAddr}, HostAuth: []string{ns.Subnet}})
	if err != nil {
		os.RemoveAll(dir)
		if errors.Is(err, pglocal.ErrNoBinaries) {
			t.Skipf("vanished-host test: %v", err)
		}
		require.NoError(t, err)
	}
	t.Cleanup(func() { _ = c.Remove(context.Background()) })
	require.NoError(t, c.Start(ctx))
	admin, err := pgx.Connect(ctx, c.URL("postgres"))
	require.NoError(t, err)
	_, err = admin.Exec(ctx, "CREATE DATABASE vanish")
	_ = admin.Close(ctx)
	require.NoError(t, err)
	dbURL := c.URL("vanish")
	_, err = migrations.UpURL(ctx, dbURL, nil)
	require.NoError(t, err)
	pool, err := pgdb.Connect(ctx, pgdb.Config{URL: dbURL, AppName: "vanish-test", MaxConns: 20})
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return ns, &pgtest.DB{Name: "vanish", URL: dbURL, DirectURL: dbURL, Pool: pool}
}

// viaLink is dbURL with its host replaced by the namespace link's host end.
func viaLink(t *testing.T, dbURL string, ns *netns.Namespace) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	require.NoError(t, err)
	u.Host = ns.HostAddr + ":" + u.Port()
	return u.String()
}

// logTime is the time= of the first line of a text log that contains msg.
func logTime(logs, msg string) (time.Time, bool) {
	sc := bufio.NewScanner(strings.NewReader(logs))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.Contains(line, msg) {
			continue
		}
		for _, f := range strings.Fields(line) {
			if v, ok := strings.CutPrefix(f, "time="); ok {
				at, err := time.Parse(time.RFC3339Nano, v)
				return at, err == nil
			}
		}
	}
	return time.Time{}, false
}

// TestLivenessVanishedHost: a worker runs in a network namespace and
// reaches PostgreSQL over a veth link; with default timings (TTL 15 s), the
// link is cut so that every packet is lost silently, as when a host loses
// power: no FIN, no RST. The server notices the liveness session gone
// through its keepalives and tcp_user_timeout (about 3 s), and the survivor
// then releases and takes every lease of the vanished member before it
// would have expired. Order: the vanished member stopped trusting its
// leases (its liveness ping failed) before the survivor released them, it
// committed nothing after the takeover, and no key ran on both workers.
func TestLivenessVanishedHost(t *testing.T) {
	ns, db := vanishSetup(t)
	f := failoverOn(t, db)
	f.installChaosSchema(t)

	args := []string{"--work", "50ms"}
	a := f.startIn(t, ns, "wa", viaLink(t, db.URL, ns), args...)
	f.waitHeld(t, "wa", allLeases, 30*time.Second)
	b := f.start(t, "wb", db.URL, args...)
	require.Eventually(t, func() bool { return f.held(t, "wb") >= 50 && f.held(t, "wa") >= 50 }, 20*time.Second, 20*time.Millisecond)
	stop := f.enqueue(t)
	require.Eventually(t, func() bool {
		return count(t, db.Pool, "SELECT count(*) FROM reconcile_log WHERE owner = $1", "wa") >= 10
	}, 30*time.Second, 20*time.Millisecond, "wa reconciles under load")
	require.Eventually(t, func() bool { return strings.Contains(a.Logs(), "liveness session up") }, 10*time.Second, 20*time.Millisecond)

	victim := heldBy(t, f, "wa")
	require.NoError(t, ns.Vanish(context.Background()))
	took := f.waitHeld(t, "wb", allLeases, 30*time.Second)
	t.Logf("vanished host with a liveness session: B held all %d leases %s after the cut (TTL 15 s)", allLeases, took.Round(time.Millisecond))
	require.Equal(t, len(victim), takenBefore(t, f, "wb", victim), "the survivor took every lease before it expired: the liveness path, not the TTL")
	require.False(t, a.Exited(), "the vanished member still runs: it only lost its network")

	lost, ok := logTime(a.Logs(), "liveness session lost")
	require.True(t, ok, "the vanished member saw its liveness session fail:\n%s", a.Logs())
	released, ok := logTime(b.Logs(), "member's liveness session is gone")
	require.True(t, ok, "the survivor released the vanished member's leases on its behalf")
	require.True(t, lost.Before(released), "the vanished member stopped trusting (%s) before the survivor released its leases (%s)",
		lost.Format(time.RFC3339Nano), released.Format(time.RFC3339Nano))

	stop()
	f.drained(t)
	require.Zero(t, count(t, db.Pool, `SELECT count(*) FROM reconcile_log r JOIN leases l ON l.name = r.lease
		WHERE r.owner = 'wa' AND l.owner = 'wb' AND r.finished_at >= l.acquired_at`), "no write of the vanished member after the takeover")
	for _, inv := range chaosInvariants[:5] {
		require.Zero(t, count(t, db.Pool, inv.violations), inv.name)
	}
	a.Kill()
}
