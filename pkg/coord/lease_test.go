package coord_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgnotify"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

type bundle struct {
	db   *pgxpool.Pool
	a, b *coord.Client
}

func setup(t *testing.T) bundle {
	t.Helper()
	db := pgtest.New(t)
	a, err := coord.NewClient(db, "owner-a")
	require.NoError(t, err)
	b, err := coord.NewClient(db, "owner-b")
	require.NoError(t, err)
	return bundle{db: db, a: a, b: b}
}

func names(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s:%d", prefix, i)
	}
	return out
}

func TestRaceExactlyOneWinnerPerName(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	ns := names("shard", 64)

	var wg sync.WaitGroup
	grants := make([]coord.Grant, 2)
	for i, c := range []*coord.Client{s.a, s.b} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g, err := c.AcquireMany(ctx, ns, 10*time.Second)
			require.NoError(t, err)
			grants[i] = g
		}()
	}
	wg.Wait()
	owners := map[string]string{}
	for i, g := range grants {
		for _, l := range g.Leases {
			prev, dup := owners[l.Name]
			require.False(t, dup, "%s granted to %s and client %d", l.Name, prev, i)
			owners[l.Name] = l.Owner
			require.EqualValues(t, 1, l.Epoch, "first holder gets epoch 1")
		}
	}
	require.Len(t, owners, len(ns), "every name has exactly one winner")

	// A renewal by the winner keeps the epoch; the loser still gets nothing.
	for _, c := range []*coord.Client{s.a, s.b} {
		g, err := c.AcquireMany(ctx, ns, 10*time.Second)
		require.NoError(t, err)
		for _, l := range g.Leases {
			require.Equal(t, c.Owner(), owners[l.Name])
			require.EqualValues(t, 1, l.Epoch, "renewal never bumps the epoch")
		}
	}
}

func TestEpochRisesOnChangeOfOwnerOnly(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()

	l, ok, err := s.a.Acquire(ctx, "singleton:sweeper", 10*time.Second)
	require.NoError(t, err)
	require.True(t, ok)
	require.EqualValues(t, 1, l.Epoch)
	for range 3 {
		l, ok, err = s.a.Acquire(ctx, "singleton:sweeper", 10*time.Second)
		require.NoError(t, err)
		require.True(t, ok)
		require.EqualValues(t, 1, l.Epoch)
	}
	_, ok, err = s.b.Acquire(ctx, "singleton:sweeper", 10*time.Second)
	require.NoError(t, err)
	require.False(t, ok, "a live lease never changes hands")

	released, err := s.a.Release(ctx, "singleton:sweeper")
	require.NoError(t, err)
	require.Equal(t, []string{"singleton:sweeper"}, released)

	// Release sets expires_at to -infinity: B takes over at once.
	lb, ok, err := s.b.Acquire(ctx, "singleton:sweeper", 10*time.Second)
	require.NoError(t, err)
	require.True(t, ok, "release lets the other take over at once")
	require.EqualValues(t, 2, lb.Epoch)

	// A's release of a lease it no longer holds touches nothing.
	released, err = s.a.Release(ctx, "singleton:sweeper")
	require.NoError(t, err)
	require.Empty(t, released)
	var owner string
	require.NoError(t, s.db.QueryRow(ctx, "SELECT owner FROM leases WHERE name = 'singleton:sweeper'").Scan(&owner))
	require.Equal(t, "owner-b", owner)
}

func TestReleaseNotifies(t *testing.T) {
	t.Parallel()
	if !pgtest.NotifyAvailable() {
		t.Skip("no LISTEN in this pgtest mode")
	}
	db := pgtest.NewDB(t)
	a, err := coord.NewClient(db.Pool, "owner-a")
	require.NoError(t, err)
	s := bundle{db: db.Pool, a: a}
	ctx := context.Background()
	// LISTEN needs a session connection: the direct URL, never PgBouncer's.
	listener, err := pgx.Connect(ctx, db.DirectURL)
	require.NoError(t, err)
	defer listener.Close(ctx)
	_, err = listener.Exec(ctx, "LISTEN "+pgnotify.LeaseReleased)
	require.NoError(t, err)

	_, ok, err := s.a.Acquire(ctx, "gateway:gw_1", time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	_, err = s.a.Release(ctx, "gateway:gw_1")
	require.NoError(t, err)

	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	n, err := listener.WaitForNotification(wctx)
	require.NoError(t, err)
	require.Equal(t, "gateway:gw_1", n.Payload)
}

func TestExpiredLeaseIsTakenOverWithNewEpoch(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	// A's TTL is long enough that B's first try cannot find it expired on a
	// busy machine; a short second grant then runs out for real.
	_, ok, err := s.a.Acquire(ctx, "shard:7", time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	_, ok, err = s.b.Acquire(ctx, "shard:7", time.Second)
	require.NoError(t, err)
	require.False(t, ok)
	_, ok, err = s.a.Acquire(ctx, "shard:7", 50*time.Millisecond)
	require.NoError(t, err)
	require.True(t, ok)
	require.Eventually(t, func() bool {
		l, ok, err := s.b.Acquire(ctx, "shard:7", time.Second)
		return err == nil && ok && l.Epoch == 2
	}, 5*time.Second, 10*time.Millisecond)
}

// waitExpired waits until the database sees the lease on name expired
// (compute_now() past expires_at).
func waitExpired(t *testing.T, db *pgxpool.Pool, name string) {
	t.Helper()
	require.Eventually(t, func() bool {
		var expired bool
		err := db.QueryRow(context.Background(), "SELECT expires_at < compute_now() FROM leases WHERE name = $1", name).Scan(&expired)
		return err == nil && expired
	}, 30*time.Second, 10*time.Millisecond, "the lease on %s expires", name)
}

func createLog(t *testing.T, db *pgxpool.Pool) {
	t.Helper()
	_, err := db.Exec(context.Background(), "CREATE TABLE fenced_log (writer text, epoch bigint, note text)")
	require.NoError(t, err)
}

func countLog(t *testing.T, db *pgxpool.Pool, writer string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(context.Background(), "SELECT count(*) FROM fenced_log WHERE writer = $1", writer).Scan(&n))
	return n
}

// TestFenceMakesTakeoverWait is docs/design.md#fencing: holder A's open fenced
// transaction makes B's takeover wait; once A commits B takes over at
// epoch+1; a transaction fenced at the old epoch then fails and commits
// nothing.
func TestFenceMakesTakeoverWait(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	createLog(t, s.db)

	la, ok, err := s.a.Acquire(ctx, "shard:1", 200*time.Millisecond)
	require.NoError(t, err)
	require.True(t, ok)

	txA, err := s.db.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, coord.Fence(ctx, txA, la))
	_, err = txA.Exec(ctx, "INSERT INTO fenced_log VALUES ('a', $1, 'inside fence')", la.Epoch)
	require.NoError(t, err)

	waitExpired(t, s.db, "shard:1") // A's transaction is still open

	type result struct {
		l   coord.Lease
		ok  bool
		err error
	}
	done := make(chan result, 1)
	go func() {
		l, ok, err := s.b.Acquire(ctx, "shard:1", 10*time.Second)
		done <- result{l, ok, err}
	}()

	// B's UPDATE is blocked on A's share lock: visible as a lock wait.
	require.Eventually(t, func() bool {
		var waiting int
		_ = s.db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%UPDATE leases%'`).Scan(&waiting)
		return waiting == 1
	}, 5*time.Second, 10*time.Millisecond)
	select {
	case r := <-done:
		t.Fatalf("takeover did not wait for the fenced transaction: %+v", r)
	case <-time.After(200 * time.Millisecond):
	}

	require.NoError(t, txA.Commit(ctx))
	r := <-done
	require.NoError(t, r.err)
	require.True(t, r.ok)
	require.Equal(t, la.Epoch+1, r.l.Epoch)
	require.Equal(t, 1, countLog(t, s.db, "a"), "A committed before B started")

	// A transaction fenced at the old epoch now fails and writes nothing.
	stale := la
	stale.ValidUntil = time.Time{} // a paused process does not know its lease ran out
	err = coord.RunFenced(ctx, s.db, stale, coord.FenceOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "INSERT INTO fenced_log VALUES ('a-stale', $1, 'after takeover')", stale.Epoch)
		return err
	})
	require.ErrorIs(t, err, coord.ErrLeaseLost)
	var lost *coord.LeaseLostError
	require.ErrorAs(t, err, &lost)
	require.Equal(t, "shard:1", lost.Name)
	require.Contains(t, err.Error(), "lease shard:1 is no longer held")
	require.Zero(t, countLog(t, s.db, "a-stale"), "the stale transaction committed nothing")

	// B's fenced transaction at the new epoch commits.
	require.NoError(t, s.b.RunFenced(ctx, r.l, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "INSERT INTO fenced_log VALUES ('b', $1, 'new holder')", r.l.Epoch)
		return err
	}))
	require.Equal(t, 1, countLog(t, s.db, "b"))
}

// TestPausedHolderCannotCommit: A holds a lease, "pauses" past its TTL while
// B takes over, then wakes and writes: the fenced write fails. The write is
// attempted after the takeover, inside a transaction that began before it.
func TestPausedHolderCannotCommit(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	createLog(t, s.db)

	la, ok, err := s.a.Acquire(ctx, "singleton:janitor", 100*time.Millisecond)
	require.NoError(t, err)
	require.True(t, ok)
	la.ValidUntil = time.Time{} // the paused process's own view: still valid

	waitExpired(t, s.db, "singleton:janitor") // the pause
	lb, ok, err := s.b.Acquire(ctx, "singleton:janitor", 10*time.Second)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, la.Epoch+1, lb.Epoch)

	err = coord.RunFenced(ctx, s.db, la, coord.FenceOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "INSERT INTO fenced_log VALUES ('a', $1, 'woke up')", la.Epoch)
		return err
	})
	require.ErrorIs(t, err, coord.ErrLeaseLost)
	require.Zero(t, countLog(t, s.db, "a"))
}

// TestFencedTransactionEndsWithValidity: a fenced transaction that runs past
// the lease's validity is cancelled and commits nothing.
func TestFencedTransactionEndsWithValidity(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	createLog(t, s.db)
	l, ok, err := s.a.Acquire(ctx, "singleton:slow", 300*time.Millisecond)
	require.NoError(t, err)
	require.True(t, ok)
	err = s.a.RunFenced(ctx, l, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO fenced_log VALUES ('a', $1, 'slow')", l.Epoch); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "SELECT pg_sleep(2)")
		return err
	})
	require.Error(t, err)
	require.Zero(t, countLog(t, s.db, "a"))
}

func TestNestedTransactionsAreSavepoints(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	createLog(t, s.db)
	l, _, err := s.a.Acquire(ctx, "shard:2", 10*time.Second)
	require.NoError(t, err)
	err = s.a.RunFenced(ctx, l, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO fenced_log VALUES ('outer', 1, '')"); err != nil {
			return err
		}
		inner := errors.New("inner fails")
		err := pgdbInTx(ctx, tx, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "INSERT INTO fenced_log VALUES ('inner', 1, '')"); err != nil {
				return err
			}
			return inner
		})
		require.ErrorIs(t, err, inner)
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, 1, countLog(t, s.db, "outer"))
	require.Zero(t, countLog(t, s.db, "inner"), "the failed savepoint rolled back alone")
}

func TestStatementTimeoutBoundsFencedTransaction(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	l, _, err := s.a.Acquire(ctx, "shard:3", time.Minute)
	require.NoError(t, err)
	start := time.Now()
	err = coord.RunFenced(ctx, s.db, l, coord.FenceOptions{StatementTimeout: 200 * time.Millisecond}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "SELECT pg_sleep(5)")
		return err
	})
	require.Error(t, err)
	require.Contains(t, err.Error(), "statement timeout")
	require.Less(t, time.Since(start), 3*time.Second)
}

func TestBadInputIsRefusedBeforeSQL(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	badNames := []string{
		"",
		strings.Repeat("a", 201),
		"has space",
		"ünïcode",
		"shard:1'; DROP TABLE leases; --",
		"name\x00nul",
		"tab\tname",
		"semi;colon",
		"quote\"d",
	}
	for _, n := range badNames {
		_, err := s.a.AcquireMany(ctx, []string{n}, time.Second)
		require.ErrorIs(t, err, coord.ErrInvalidName, "name %q", n)
		var ve *coord.ValidationError
		require.ErrorAs(t, err, &ve)
		require.Equal(t, "name", ve.Field)
		_, err = s.a.Release(ctx, n)
		require.ErrorIs(t, err, coord.ErrInvalidName, "release %q", n)
	}
	_, err := s.a.AcquireMany(ctx, nil, time.Second)
	require.ErrorIs(t, err, coord.ErrInvalidName)
	_, err = s.a.AcquireMany(ctx, []string{"x", "x"}, time.Second)
	require.ErrorIs(t, err, coord.ErrInvalidName)

	badTTLs := []time.Duration{0, -time.Second, 1500 * time.Microsecond, time.Microsecond, 24*time.Hour + time.Millisecond}
	for _, ttl := range badTTLs {
		_, err := s.a.AcquireMany(ctx, []string{"shard:1"}, ttl)
		require.ErrorIs(t, err, coord.ErrInvalidTTL, "ttl %v", ttl)
		var ve *coord.ValidationError
		require.ErrorAs(t, err, &ve)
		require.Equal(t, "ttl", ve.Field)
	}
	// The edges are valid.
	require.NoError(t, coord.ValidateTTL(time.Millisecond))
	require.NoError(t, coord.ValidateTTL(24*time.Hour))
	require.NoError(t, coord.ValidateName(strings.Repeat("a", 200)))

	_, err = coord.NewClient(s.db, "bad owner")
	require.ErrorIs(t, err, coord.ErrInvalidOwner)

	// No SQL ran: not even the insert of missing rows.
	var n int
	require.NoError(t, s.db.QueryRow(ctx, "SELECT count(*) FROM leases").Scan(&n))
	require.Zero(t, n)
}

// TestBadInputRunsNoSQL proves validation happens before any statement: the
// client's pool points at a closed port, so any SQL would fail with a
// connection error instead of the typed validation error.
func TestBadInputRunsNoSQL(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	require.NoError(t, err)
	defer pool.Close()
	c, err := coord.NewClient(pool, "owner-x")
	require.NoError(t, err)
	_, err = c.AcquireMany(context.Background(), []string{"bad name"}, time.Second)
	require.ErrorIs(t, err, coord.ErrInvalidName)
	_, err = c.AcquireMany(context.Background(), []string{"good"}, 0)
	require.ErrorIs(t, err, coord.ErrInvalidTTL)
}

func TestClockSkewIsDetected(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	var samples []time.Duration
	det := coord.NewSkewDetector(time.Second, nil, func(d time.Duration) { samples = append(samples, d) })
	c, err := coord.NewClient(s.db, "owner-skew", coord.WithSkewDetector(det))
	require.NoError(t, err)

	_, err = c.AcquireMany(ctx, []string{"shard:9"}, time.Second)
	require.NoError(t, err)
	skew, bad := det.Last()
	require.False(t, bad, "same host: no skew (got %v)", skew)

	// The database clock runs 3 s ahead of this process.
	_, err = s.db.Exec(ctx, "CREATE OR REPLACE FUNCTION compute_now() RETURNS timestamptz LANGUAGE sql AS $$ SELECT clock_timestamp() + interval '3 seconds' $$")
	require.NoError(t, err)
	g, err := c.AcquireMany(ctx, []string{"shard:9"}, time.Second)
	require.NoError(t, err)
	require.InDelta(t, -3*time.Second, g.Skew, float64(500*time.Millisecond))
	skew, bad = det.Last()
	require.True(t, bad)
	require.Less(t, skew, -2*time.Second)
	require.Len(t, samples, 2)

	// A statement granting nothing still samples the clock.
	other, err := coord.NewClient(s.db, "owner-other", coord.WithSkewDetector(det))
	require.NoError(t, err)
	g, err = other.AcquireMany(ctx, []string{"shard:9"}, time.Second)
	require.NoError(t, err)
	require.Empty(t, g.Leases)
	require.False(t, g.Now.IsZero())
}
