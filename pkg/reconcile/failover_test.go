package reconcile_test

import (
	"context"
	"fmt"
	"net/url"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/faultproxy"
	"github.com/leasehold/leasehold/pkg/netns"
	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
	"github.com/leasehold/leasehold/pkg/queue"
)

// allLeases is what one testworker holds alone: 256 shards and 2 singletons.
const allLeases = coord.NumShards + 2

// fastArgs shorten the timings for tests whose subject is ordering, not the
// default durations.
var fastArgs = []string{"--coord.lease-ttl", "3s", "--coord.renew-interval", "1s", "--coord.live-window", "6s",
	"--coord.statement-timeout", "1s", "--coord.self-release-after", "2s"}

type failover struct {
	db  *pgtest.DB
	bin string
	// tolerateOutages: enqueue skips a key the database could not take
	// (the run stops the database on purpose).
	tolerateOutages bool
}

func setupFailover(t *testing.T) failover {
	t.Helper()
	if testing.Short() {
		t.Skip("real-time failover test")
	}
	return failoverOn(t, pgtest.NewDB(t))
}

// failoverOn is setupFailover on a given database (a test's own server).
func failoverOn(t *testing.T, db *pgtest.DB) failover {
	t.Helper()
	exec(t, db.Pool, "CREATE TABLE reconcile_log (key text, owner text, started_at timestamptz, finished_at timestamptz)")
	exec(t, db.Pool, "CREATE TABLE period_log (period bigint, owner text, at timestamptz)")
	return failover{db: db, bin: proctest.Build(t, "./internal/testworker")}
}

func (f failover) start(t *testing.T, id, dbURL string, extra ...string) *proctest.Proc {
	t.Helper()
	return f.startIn(t, nil, id, dbURL, extra...)
}

// startIn starts a testworker inside ns (nil: on the host); its HTTP
// server listens on the namespace's address, where the host reaches it.
func (f failover) startIn(t *testing.T, ns *netns.Namespace, id, dbURL string, extra ...string) *proctest.Proc {
	t.Helper()
	port, err := pglocal.FreePort()
	require.NoError(t, err)
	host := "127.0.0.1"
	if ns != nil {
		host = ns.NSAddr
	}
	args := append([]string{"--id", id, "--database-url", dbURL, "--http-addr", fmt.Sprintf("%s:%d", host, port),
		"--log-format", "text", "--coord.poll-interval", "50ms",
		// Keys a dead worker had claimed wait out the claim TTL (the second
		// safety net); 10 s instead of 60 s keeps the drain check short.
		"--coord.claim-ttl", "10s"}, pgtest.PoolerFlags(dbURL)...)
	args = append(args, extra...)
	bin := f.bin
	if ns != nil {
		bin, args = ns.Command(f.bin, args...)
	}
	p := proctest.Start(t, id, bin, nil, args...)
	p.WaitReady(20 * time.Second)
	return p
}

func (f failover) held(t *testing.T, owner string) int {
	return count(t, f.db.Pool, "SELECT count(*) FROM leases WHERE owner = $1 AND expires_at > compute_now()", owner)
}

// enqueue adds a key every 10 ms until stop is called; it returns how many.
func (f failover) enqueue(t *testing.T) (stop func() int) {
	t.Helper()
	var n atomic.Int64
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-done:
				return
			case <-time.After(10 * time.Millisecond):
			}
			i := n.Add(1)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			_, err := queue.Enqueue(ctx, f.db.Pool, "logkeys", fmt.Sprintf("key-%d", i%500), 0)
			cancel()
			if err != nil && f.tolerateOutages && coord.Unreachable(err) {
				n.Add(-1)
				continue
			}
			if err != nil {
				t.Errorf("enqueue: %v", err)
				return
			}
		}
	}()
	var once sync.Once
	stop = func() int { once.Do(func() { close(done); wg.Wait() }); return int(n.Load()) }
	t.Cleanup(func() { stop() })
	return stop
}

// overlaps counts pairs of runs of one key by two workers whose fenced
// transactions overlapped in time: the invariant is that there are none.
func (f failover) overlaps(t *testing.T) int {
	return count(t, f.db.Pool, `
SELECT count(*) FROM reconcile_log a JOIN reconcile_log b
  ON a.key = b.key AND a.owner < b.owner
 AND tstzrange(a.started_at, a.finished_at, '[]') && tstzrange(b.started_at, b.finished_at, '[]')`)
}

func (f failover) waitHeld(t *testing.T, owner string, want int, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	require.Eventually(t, func() bool { return f.held(t, owner) == want }, within, 20*time.Millisecond,
		"%s holds %d leases within %s", owner, want, within)
	return time.Since(start)
}

func (f failover) drained(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool { return count(t, f.db.Pool, "SELECT count(*) FROM work_queue") == 0 },
		30*time.Second, 50*time.Millisecond, "the survivor keeps working: the queue drains")
}

// TestWorkerFailoverConnectionKilled is the reference's worker failover: A
// takes every lease, B starts, A's database connection is killed (no
// release) while keys are enqueued; B holds every lease A held within 22 s
// (TTL 15 s + renew 5 s + 2 s), keeps working, and no key ran on both at once.
func TestWorkerFailoverConnectionKilled(t *testing.T) {
	t.Parallel()
	f := setupFailover(t)
	u, err := url.Parse(f.db.URL)
	require.NoError(t, err)
	proxy, err := faultproxy.New(u.Host)
	require.NoError(t, err)
	defer proxy.Close()
	viaProxy := *u
	viaProxy.Host = proxy.Addr()

	// A's pool goes through the proxy, its LISTEN connection directly (or,
	// through PgBouncer, the flags of the pgtest mode).
	listen := pgtest.PoolerFlags(f.db.URL)
	if !pgtest.Pooled() {
		listen = []string{"--listen-database-url", f.db.DirectURL}
	}
	f.start(t, "wa", viaProxy.String(), listen...)
	f.waitHeld(t, "wa", allLeases, 30*time.Second)
	f.start(t, "wb", f.db.URL)
	stop := f.enqueue(t)
	require.Eventually(t, func() bool {
		return count(t, f.db.Pool, "SELECT count(*) FROM reconcile_log WHERE owner = $1", "wa") >= 20
	}, 30*time.Second, 20*time.Millisecond, "wa reconciles under load")

	proxy.Refuse()
	proxy.CutAll() // A's pool connections die mid-flight; nothing is released
	took := f.waitHeld(t, "wb", allLeases, 22*time.Second)
	t.Logf("crash (connection killed): B held all %d leases %s after the kill", allLeases, took.Round(time.Millisecond))
	byB := count(t, f.db.Pool, "SELECT count(*) FROM reconcile_log WHERE owner = $1", "wb")
	require.Eventually(t, func() bool {
		return count(t, f.db.Pool, "SELECT count(*) FROM reconcile_log WHERE owner = $1", "wb") >= byB+20
	}, 30*time.Second, 20*time.Millisecond, "wb reconciles under load")
	enqueued := stop()
	f.drained(t)
	require.Zero(t, f.overlaps(t), "no key ran on both workers at once")
	require.Positive(t, count(t, f.db.Pool, "SELECT count(*) FROM reconcile_log WHERE owner = 'wb'"))
	t.Logf("keys enqueued: %d, runs logged: %d", enqueued, count(t, f.db.Pool, "SELECT count(*) FROM reconcile_log"))
}

// TestWorkerFailoverSIGKILL measures the crash takeover with default timings.
func TestWorkerFailoverSIGKILL(t *testing.T) {
	t.Parallel()
	f := setupFailover(t)
	a := f.start(t, "wa", f.db.URL)
	f.waitHeld(t, "wa", allLeases, 30*time.Second)
	f.start(t, "wb", f.db.URL)
	stop := f.enqueue(t)
	require.Eventually(t, func() bool {
		return count(t, f.db.Pool, "SELECT count(*) FROM reconcile_log WHERE owner = $1", "wa") >= 20
	}, 30*time.Second, 20*time.Millisecond, "wa reconciles under load")
	a.Kill()
	took := f.waitHeld(t, "wb", allLeases, 22*time.Second)
	t.Logf("crash (SIGKILL): B held all %d leases %s after the kill", allLeases, took.Round(time.Millisecond))
	stop()
	f.drained(t)
	require.Zero(t, f.overlaps(t))
	// The periodic singleton went on at the next period: no skip, no repeat.
	require.Positive(t, count(t, f.db.Pool, "SELECT count(*) FROM period_log WHERE owner = 'wb'"))
	require.Zero(t, count(t, f.db.Pool, `SELECT count(*) FROM (SELECT period - lag(period) OVER (ORDER BY period) AS d FROM period_log) x WHERE d <> 1`))
}

// TestPausedWorkerCommitsNothingAfterTakeover: SIGSTOP a holder past its
// TTL, let another take over, SIGCONT it: none of its writes commit after
// the takeover.
func TestPausedWorkerCommitsNothingAfterTakeover(t *testing.T) {
	t.Parallel()
	f := setupFailover(t)
	a := f.start(t, "wa", f.db.URL, append(fastArgs, "--work", "200ms")...)
	f.waitHeld(t, "wa", allLeases, 30*time.Second)
	f.start(t, "wb", f.db.URL, fastArgs...)
	stop := f.enqueue(t)
	// Wait until A is inside a fenced transaction, so the pause holds a
	// share lock on a shard lease row.
	require.Eventually(t, func() bool {
		return count(t, f.db.Pool, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = 'leasehold-testworker:wa' AND state = 'active' AND query LIKE '%pg_sleep%'`) > 0
	}, 10*time.Second, 5*time.Millisecond)
	a.Pause()
	took := f.waitHeld(t, "wb", allLeases, 20*time.Second)
	var takeover time.Time
	require.NoError(t, f.db.Pool.QueryRow(context.Background(), "SELECT compute_now()").Scan(&takeover))
	t.Logf("pause (SIGSTOP): B held all %d leases %s after the pause", allLeases, took.Round(time.Millisecond))

	a.Resume()
	time.Sleep(4 * time.Second) // a window for the woken A to try to finish and reconcile more: what is checked is that nothing of it lands
	stop()
	f.drained(t)
	require.Zero(t, count(t, f.db.Pool, "SELECT count(*) FROM reconcile_log WHERE owner = 'wa' AND (started_at >= $1 OR finished_at >= $1)", takeover),
		"no write of the paused worker committed after the takeover")
	require.Zero(t, count(t, f.db.Pool, "SELECT count(*) FROM period_log WHERE owner = 'wa' AND at >= $1", takeover))
	require.Zero(t, f.held(t, "wa"))
	require.Zero(t, f.overlaps(t))
	// Periods stayed consecutive across the takeover.
	require.Zero(t, count(t, f.db.Pool, `SELECT count(*) FROM (SELECT period - lag(period) OVER (ORDER BY period) AS d FROM period_log) x WHERE d <> 1`))
}

// TestSIGTERMHandsOverWellUnderARenewalPeriod: with default timings
// (renew 5 s) the survivor holds everything at once through NOTIFY.
func TestSIGTERMHandsOverWellUnderARenewalPeriod(t *testing.T) {
	t.Parallel()
	if !pgtest.NotifyAvailable() {
		t.Skip("no LISTEN in this pgtest mode: the survivor takes over at its next pass (polling), not at once")
	}
	f := setupFailover(t)
	a := f.start(t, "wa", f.db.URL)
	f.waitHeld(t, "wa", allLeases, 30*time.Second)
	f.start(t, "wb", f.db.URL)
	// Wait until the two have split the shards.
	require.Eventually(t, func() bool { return f.held(t, "wb") >= 100 && f.held(t, "wa")+f.held(t, "wb") == allLeases },
		20*time.Second, 20*time.Millisecond)
	stop := f.enqueue(t)
	require.Eventually(t, func() bool {
		return count(t, f.db.Pool, "SELECT count(*) FROM reconcile_log WHERE owner = $1", "wa") >= 10
	}, 30*time.Second, 20*time.Millisecond, "wa reconciles under load")
	start := time.Now()
	a.Signal(syscall.SIGTERM)
	took := f.waitHeld(t, "wb", allLeases, 5*time.Second)
	require.Equal(t, 0, a.Wait(10*time.Second))
	t.Logf("SIGTERM handover: B held all %d leases %s after SIGTERM (renew period 5s)", allLeases, took.Round(time.Millisecond))
	require.Less(t, time.Since(start), 2500*time.Millisecond, "well under one renewal period")
	stop()
	f.drained(t)
	require.Zero(t, f.overlaps(t))
	require.Zero(t, count(t, f.db.Pool, "SELECT count(*) FROM workers WHERE id = 'wa'"))
}
