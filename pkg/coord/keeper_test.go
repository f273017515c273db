package coord_test

import (
	"context"
	"errors"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jonboulle/clockwork"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/faultproxy"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestTakeRenewAndTakeFreshFollowTheEpochRule(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()

	a, ok, err := coord.Take(ctx, db, "site:s1:boot", "agent-a", time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	require.EqualValues(t, 1, a.Epoch, "the first holder gets epoch 1")
	require.True(t, a.ExpiresAt.After(a.GrantedAt))

	again, ok, err := coord.Take(ctx, db, "site:s1:boot", "agent-a", time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, a.Epoch, again.Epoch, "the same owner keeps its epoch")

	_, ok, err = coord.Take(ctx, db, "site:s1:boot", "agent-b", time.Minute)
	require.NoError(t, err)
	require.False(t, ok, "a live lease is not taken by another owner")

	renewed, ok, err := coord.Renew(ctx, db, a, 2*time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, a.Epoch, renewed.Epoch)
	require.True(t, renewed.ExpiresAt.After(a.ExpiresAt))

	fresh, ok, err := coord.TakeFresh(ctx, db, "site:s1:boot", "agent-a", time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, a.Epoch+1, fresh.Epoch, "a fresh take by the same owner starts a new holding")

	_, ok, err = coord.Renew(ctx, db, a, time.Minute)
	require.NoError(t, err)
	require.False(t, ok, "the old holding cannot be renewed")

	_, err = db.Exec(ctx, `UPDATE leases SET expires_at = '-infinity' WHERE name = 'site:s1:boot'`)
	require.NoError(t, err)
	b, ok, err := coord.Take(ctx, db, "site:s1:boot", "agent-b", time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, fresh.Epoch+1, b.Epoch, "a change of owner raises the epoch")

	_, _, err = coord.Take(ctx, db, "bad name!", "agent-b", time.Minute)
	require.Error(t, err)
}

func TestEpochFloorIsZeroBeforeAnyFailover(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	var floor int64
	require.NoError(t, db.QueryRow(context.Background(), `SELECT lease_epoch_floor()`).Scan(&floor))
	require.Zero(t, floor, "a cluster on timeline 1 issues epochs 1, 2, 3, ...")

	// Services connect as an ordinary role, not a superuser.
	ctx := context.Background()
	_, err := db.Exec(ctx, `DO $$ BEGIN CREATE ROLE leasehold_plain NOLOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$`)
	require.NoError(t, err)
	require.NoError(t, pgdb.InTx(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL ROLE leasehold_plain`); err != nil {
			return err
		}
		return tx.QueryRow(ctx, `SELECT lease_epoch_floor()`).Scan(&floor)
	}))
	require.Zero(t, floor)
}

func TestUnreachableTellsAnOutageFromAnAnswer(t *testing.T) {
	t.Parallel()
	require.False(t, coord.Unreachable(nil))
	require.True(t, coord.Unreachable(context.DeadlineExceeded))
	require.True(t, coord.Unreachable(errors.New("dial tcp 127.0.0.1:1: connect: connection refused")))
	require.True(t, coord.Unreachable(&pgconn.PgError{Code: "57P01"}), "admin shutdown")
	require.True(t, coord.Unreachable(&pgconn.PgError{Code: "57P03"}), "starting up")
	require.True(t, coord.Unreachable(&pgconn.PgError{Code: "08006"}), "connection failure")
	require.True(t, coord.Unreachable(&pgconn.PgError{Code: "25006"}), "read-only: a standby")
	require.False(t, coord.Unreachable(&pgconn.PgError{Code: "42P01"}), "an answer: undefined table")
	require.False(t, coord.Unreachable(&pgconn.PgError{Code: "40P01"}), "an answer: deadlock")

	// A real answer from a real server.
	db := pgtest.New(t)
	_, err := db.Exec(context.Background(), `SELECT * FROM no_such_table`)
	require.Error(t, err)
	require.False(t, coord.Unreachable(err))
}

type keeperEvents struct {
	acquired chan coord.Lease
	lost     chan string
}

func newKeeperEvents() *keeperEvents {
	return &keeperEvents{acquired: make(chan coord.Lease, 16), lost: make(chan string, 16)}
}

func (e *keeperEvents) config(name string, ttl, renew, trust time.Duration) coord.KeeperConfig {
	return coord.KeeperConfig{Name: name, TTL: ttl, Renew: renew, Trust: trust,
		OnAcquired: func(l coord.Lease) { e.acquired <- l },
		OnLost:     func(_ coord.Lease, reason string) { e.lost <- reason },
	}
}

func runKeeper(t *testing.T, k *coord.Keeper) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); k.Run(ctx) }()
	t.Cleanup(func() { cancel(); wg.Wait() })
}

func receive[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(30 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
		panic("unreachable")
	}
}

// fakeClockKeeper runs a keeper of name for owner on a fake clock (TTL an
// hour, renewed every minute, trusted for ten) and returns the clock, the
// keeper, its events and its first take.
func fakeClockKeeper(t *testing.T, db *pgxpool.Pool, owner, name string) (*clockwork.FakeClock, *coord.Keeper, *keeperEvents, coord.Lease) {
	t.Helper()
	clock := clockwork.NewFakeClock()
	client, err := coord.NewClient(db, owner, coord.WithClock(clock))
	require.NoError(t, err)
	ev := newKeeperEvents()
	k, err := coord.NewKeeper(client, ev.config(name, time.Hour, time.Minute, 10*time.Minute), nil)
	require.NoError(t, err)
	runKeeper(t, k)
	return clock, k, ev, receive(t, ev.acquired, "the first take")
}

// advanceUntilTaken moves clock on a second at a time until the keeper
// takes its lease again, and returns the take. A take comes at a tick of
// the keeper's ticker, and a jump of the clock may have left no tick
// pending (the fake ticker fires into a buffer of one, however far the
// clock jumps): driving the clock, not waiting on real time for a tick
// that may never come. stop, when not nil, is asked between ticks and
// ends the wait early (ok false) when it returns true.
func advanceUntilTaken(t *testing.T, clock *clockwork.FakeClock, ev *keeperEvents, what string, stop func() bool) (l coord.Lease, ok bool) {
	t.Helper()
	require.Eventually(t, func() bool {
		select {
		case l, ok = <-ev.acquired:
			return true
		default:
			if stop != nil && stop() {
				return true
			}
			clock.Advance(time.Second)
			return false
		}
	}, 30*time.Second, 10*time.Millisecond, what)
	return l, ok
}

// TestKeeperStopsTrustingAtItsDeadlineAndTakesANewEpoch is about logic, on
// an injected clock: with no successful renewal for the trust window the
// keeper calls OnLost and refuses fenced work; it then takes the lease
// again at a new epoch and calls OnAcquired.
func TestKeeperStopsTrustingAtItsDeadlineAndTakesANewEpoch(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	clock, k, ev, first := fakeClockKeeper(t, db, "gw-1", "gateway:gw-1")
	l, ok := k.Current()
	require.True(t, ok)
	require.Equal(t, first.Epoch, l.Epoch)
	require.NoError(t, k.RunFenced(context.Background(), db, func(context.Context, pgx.Tx) error { return nil }))

	// The keeper renews at each Renew; jump past the trust window at once,
	// as a pause or an outage longer than it would.
	require.NoError(t, clock.BlockUntilContext(context.Background(), 1))
	clock.Advance(11 * time.Minute)
	require.Contains(t, receive(t, ev.lost, "the loss"), "no successful renewal")
	second, _ := advanceUntilTaken(t, clock, ev, "the second take", nil)
	require.Greater(t, second.Epoch, first.Epoch, "a new holding, a new epoch")

	stale := first
	stale.ValidUntil = clock.Now().Add(time.Minute)
	err := coord.RunFenced(context.Background(), db, stale, coord.FenceOptions{Now: clock.Now}, func(context.Context, pgx.Tx) error { return nil })
	require.ErrorIs(t, err, coord.ErrLeaseLost, "nothing of the old holding passes the fence")
}

// TestKeeperDropDuringARenewalStaysDropped: a holding dropped while its
// renewal is in flight is not trusted again when the renewal comes back;
// the keeper takes the lease anew, at a new epoch, and says so.
func TestKeeperDropDuringARenewalStaysDropped(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	clock, k, ev, first := fakeClockKeeper(t, db, "gw-3", "gateway:gw-3")

	// Hold the lease row so the next renewal waits on it, in flight.
	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM leases WHERE name = 'gateway:gw-3' FOR UPDATE`)
	require.NoError(t, err)
	require.NoError(t, clock.BlockUntilContext(ctx, 1))
	clock.Advance(time.Minute)
	require.Eventually(t, func() bool {
		var waiting int
		err := db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting)
		return err == nil && waiting > 0
	}, 30*time.Second, 10*time.Millisecond, "the renewal waits on the row")

	k.Drop("test: dropped during the renewal")
	require.Contains(t, receive(t, ev.lost, "the drop"), "dropped during the renewal")
	require.NoError(t, tx.Commit(ctx)) // the renewal goes through in the database
	// The keeper may already have taken the lease again (a tick was due
	// when the renewal returned), but never at the dropped epoch.
	if l, held := k.Current(); held {
		require.NotEqual(t, first.Epoch, l.Epoch, "the renewal that came back after the drop is not trusted")
	}

	second, taken := advanceUntilTaken(t, clock, ev, "the take after the drop", func() bool {
		l, held := k.Current()
		return held && l.Epoch == first.Epoch // held again with no take: the renewal undid the drop
	})
	require.True(t, taken, "the renewal that came back after the drop is not trusted")
	require.Greater(t, second.Epoch, first.Epoch, "a new holding, a new epoch")
}

// TestKeeperDropsALeaseAFenceFindsLost: another owner took the lease; the
// next fenced transaction fails, OnLost runs, and Current is empty.
func TestKeeperDropsALeaseAFenceFindsLost(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	client, err := coord.NewClient(db, "gw-2")
	require.NoError(t, err)
	ev := newKeeperEvents()
	k, err := coord.NewKeeper(client, ev.config("gateway:gw-2", time.Hour, time.Minute, 30*time.Minute), nil)
	require.NoError(t, err)
	runKeeper(t, k)
	receive(t, ev.acquired, "the first take")

	_, err = db.Exec(context.Background(), `UPDATE leases SET owner = 'intruder', epoch = epoch + 1 WHERE name = 'gateway:gw-2'`)
	require.NoError(t, err)
	err = k.RunFenced(context.Background(), db, func(context.Context, pgx.Tx) error { return nil })
	require.ErrorIs(t, err, coord.ErrLeaseLost)
	require.Contains(t, receive(t, ev.lost, "the loss"), "fenced transaction")
	_, ok := k.Current()
	require.False(t, ok)
	err = k.RunFenced(context.Background(), db, func(context.Context, pgx.Tx) error { return nil })
	require.ErrorIs(t, err, coord.ErrNotHeld)
}

// TestKeeperRidesThroughAnOutage is about real time: the keeper's pool goes
// through a proxy that refuses and cuts every connection (the database is
// gone). The keeper stops trusting the lease at its deadline, keeps trying,
// and once the database is reachable again it holds the lease at a new
// epoch, with no restart.
func TestKeeperRidesThroughAnOutage(t *testing.T) {
	t.Parallel()
	pdb := pgtest.NewDB(t)
	u, err := url.Parse(pdb.URL)
	require.NoError(t, err)
	proxy, err := faultproxy.New(u.Host)
	require.NoError(t, err)
	defer proxy.Close()
	via := *u
	via.Host = proxy.Addr()
	ctx := context.Background()
	pool, err := pgdb.Connect(ctx, pgdb.Config{URL: via.String(), AppName: "keeper-outage", MaxConns: 4, Pooler: pgtest.Pooled()})
	require.NoError(t, err)
	defer pool.Close()

	client, err := coord.NewClient(pool, "gw-3")
	require.NoError(t, err)
	ev := newKeeperEvents()
	k, err := coord.NewKeeper(client, ev.config("gateway:gw-3", 2*time.Second, 200*time.Millisecond, time.Second), nil)
	require.NoError(t, err)
	runKeeper(t, k)
	first := receive(t, ev.acquired, "the first take")

	proxy.Refuse()
	proxy.CutAll()
	receive(t, ev.lost, "the loss during the outage")
	_, ok := k.Current()
	require.False(t, ok, "not trusted past its deadline")
	require.Error(t, k.Err(), "the keeper says why it holds nothing")
	// Stay down well past the TTL: the row expires in the database too.
	var dbExpired bool
	require.Eventually(t, func() bool {
		return pdb.Pool.QueryRow(ctx, `SELECT expires_at < compute_now() FROM leases WHERE name = 'gateway:gw-3'`).Scan(&dbExpired) == nil && dbExpired
	}, 30*time.Second, 50*time.Millisecond)

	proxy.Restore()
	second := receive(t, ev.acquired, "the take after the outage")
	require.Greater(t, second.Epoch, first.Epoch)
	require.NoError(t, k.Err())
	require.NoError(t, k.RunFenced(ctx, pool, func(context.Context, pgx.Tx) error { return nil }))
}
