package coord_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
)

// The fence locks FOR KEY SHARE (migrations 00015 and 00023 make epoch and
// owner key columns): a renewal, which moves only expires_at, passes an
// open fenced transaction; every write that ends a holding (a takeover
// raises the epoch, a release clears the owner) changes a key column and so
// still waits for it.

// waitersOn counts backends waiting on a row lock while running query.
func waitersOn(t *testing.T, s bundle, like string) int {
	t.Helper()
	var n int
	require.NoError(t, s.db.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE $1`, like).Scan(&n))
	return n
}

func TestRenewalDoesNotWaitForFencedWork(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	l, ok, err := coord.Take(ctx, s.db, "gateway:renew", "owner-a", 10*time.Second)
	require.NoError(t, err)
	require.True(t, ok)

	tx, err := s.db.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // after a commit, or when the test already failed, there is nothing to report
	require.NoError(t, coord.Fence(ctx, tx, l))

	// With the fenced transaction still open, the renewal commits (under
	// FOR SHARE it would wait until the deadline and fail).
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	renewed, ok, err := coord.Renew(rctx, s.db, l, 20*time.Second)
	require.NoError(t, err)
	require.True(t, ok)
	require.True(t, renewed.ExpiresAt.After(l.ExpiresAt))
	require.Zero(t, waitersOn(t, s, "%UPDATE leases%"))

	// The fenced transaction is still valid and commits after the renewal.
	require.NoError(t, coord.Fence(ctx, tx, renewed))
	require.NoError(t, tx.Commit(ctx))
}

func TestRenewerAcquireDoesNotWaitForFencedWork(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	l, ok, err := s.a.Acquire(ctx, "shard:7", 10*time.Second)
	require.NoError(t, err)
	require.True(t, ok)

	tx, err := s.db.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // after a commit, or when the test already failed, there is nothing to report
	require.NoError(t, coord.Fence(ctx, tx, l))

	// The renewal loop's statement (AcquireMany by the holder: same owner,
	// same epoch) commits while the fenced transaction is open.
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	renewed, ok, err := s.a.Acquire(rctx, "shard:7", 20*time.Second)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, l.Epoch, renewed.Epoch)
	require.True(t, renewed.ExpiresAt.After(l.ExpiresAt))
	require.NoError(t, tx.Commit(ctx))
}

// TestReleaseStillWaitsForFencedWork: a release by the holder (Release, and
// ReleaseAll, which shutdown, self-release and a survivor's release on
// behalf of a dead member share) waits for the holder's open fenced
// transaction, and the write commits while the lease is still held.
func TestReleaseStillWaitsForFencedWork(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		release func(ctx context.Context, c *coord.Client, name string) ([]string, error)
	}{
		{"Release", func(ctx context.Context, c *coord.Client, name string) ([]string, error) { return c.Release(ctx, name) }},
		{"ReleaseAll", func(ctx context.Context, c *coord.Client, _ string) ([]string, error) { return c.ReleaseAll(ctx) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := setup(t)
			ctx := context.Background()
			const name = "singleton:release"
			l, ok, err := s.a.Acquire(ctx, name, 10*time.Second)
			require.NoError(t, err)
			require.True(t, ok)

			tx, err := s.db.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx) //nolint:errcheck // after a commit, or when the test already failed, there is nothing to report
			require.NoError(t, coord.Fence(ctx, tx, l))

			type released struct {
				names []string
				err   error
			}
			done := make(chan released, 1)
			go func() {
				names, err := tc.release(ctx, s.a, name)
				done <- released{names, err}
			}()
			require.Eventually(t, func() bool { return waitersOn(t, s, "%UPDATE leases%") == 1 }, 10*time.Second, 10*time.Millisecond,
				"the release waits on the fenced transaction's row lock")
			select {
			case r := <-done:
				t.Fatalf("release did not wait for the fenced transaction: %+v", r)
			default:
			}
			// The fenced transaction still sees its lease held and commits.
			var owner string
			require.NoError(t, tx.QueryRow(ctx, `SELECT owner FROM leases WHERE name = $1`, name).Scan(&owner))
			require.Equal(t, "owner-a", owner)
			require.NoError(t, tx.Commit(ctx))
			r := <-done
			require.NoError(t, r.err)
			require.Equal(t, []string{name}, r.names)

			// After the release a write fenced on the old holding fails.
			tx2, err := s.db.Begin(ctx)
			require.NoError(t, err)
			defer tx2.Rollback(ctx) //nolint:errcheck // after a commit, or when the test already failed, there is nothing to report
			require.ErrorIs(t, coord.Fence(ctx, tx2, l), coord.ErrLeaseLost)
		})
	}
}

func TestTakeoverStillWaitsForFencedWork(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	l, ok, err := coord.Take(ctx, s.db, "gateway:takeover", "owner-a", time.Second)
	require.NoError(t, err)
	require.True(t, ok)

	tx, err := s.db.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // after a commit, or when the test already failed, there is nothing to report
	require.NoError(t, coord.Fence(ctx, tx, l))

	// A renewal passes the open fenced transaction...
	_, ok, err = coord.Renew(ctx, s.db, l, time.Second)
	require.NoError(t, err)
	require.True(t, ok)
	// ...then the lease runs out on the database clock, with tx still open.
	require.Eventually(t, func() bool {
		var expired bool
		_ = s.db.QueryRow(ctx, `SELECT expires_at < compute_now() FROM leases WHERE name = 'gateway:takeover'`).Scan(&expired)
		return expired
	}, 10*time.Second, 20*time.Millisecond)

	type taken struct {
		l   coord.Lease
		ok  bool
		err error
	}
	done := make(chan taken, 1)
	go func() {
		l, ok, err := coord.Take(ctx, s.db, "gateway:takeover", "owner-b", 10*time.Second)
		done <- taken{l, ok, err}
	}()
	// The takeover is blocked on the fenced transaction's row lock.
	require.Eventually(t, func() bool { return waitersOn(t, s, "%UPDATE leases%") == 1 }, 10*time.Second, 10*time.Millisecond)
	select {
	case r := <-done:
		t.Fatalf("takeover did not wait for the fenced transaction: %+v", r)
	default:
	}
	require.NoError(t, tx.Commit(ctx))
	r := <-done
	require.NoError(t, r.err)
	require.True(t, r.ok)
	require.Greater(t, r.l.Epoch, l.Epoch)
}
