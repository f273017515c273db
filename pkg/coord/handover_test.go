package coord_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
)

// TestLockForHandoverReadsTheRow: Ensure creates a missing row once and
// leaves a held one alone; LockForHandover reads an unowned row as long
// expired and a held one as it is.
func TestLockForHandoverReadsTheRow(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	require.Error(t, coord.Ensure(ctx, s.db, ""), "an invalid name is refused")

	tx, err := s.db.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // after a commit, or when the test already failed, there is nothing to report
	require.NoError(t, coord.Ensure(ctx, tx, "site:s1:boot"))
	require.NoError(t, coord.Ensure(ctx, tx, "site:s1:boot"))
	h, err := coord.LockForHandover(ctx, tx, "site:s1:boot")
	require.NoError(t, err)
	require.Equal(t, "site:s1:boot", h.Name)
	require.Empty(t, h.Owner)
	require.Zero(t, h.Epoch)
	require.Equal(t, time.Unix(0, 0).UTC(), h.ExpiresAt.UTC(), "never held reads as 1970")
	require.False(t, h.Live())
	require.NoError(t, tx.Commit(ctx))

	l, ok, err := coord.Take(ctx, s.db, "site:s1:boot", "agent-1", 10*time.Second)
	require.NoError(t, err)
	require.True(t, ok)
	require.NoError(t, coord.Ensure(ctx, s.db, "site:s1:boot"))
	tx, err = s.db.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // after a commit, or when the test already failed, there is nothing to report
	h, err = coord.LockForHandover(ctx, tx, "site:s1:boot")
	require.NoError(t, err)
	require.Equal(t, "agent-1", h.Owner, "Ensure left the held row alone")
	require.Equal(t, l.Epoch, h.Epoch)
	require.True(t, h.ExpiresAt.Equal(l.ExpiresAt))
	require.True(t, h.Live())

	_, err = coord.LockForHandover(ctx, tx, "site:missing:boot")
	require.ErrorIs(t, err, pgx.ErrNoRows, "the row must exist")
}

// TestLockForHandoverWaitsForFencedWork: the handover lock (FOR UPDATE)
// waits for an open fenced transaction (FOR KEY SHARE), and while it is
// held no fence, renewal or take gets in.
func TestLockForHandoverWaitsForFencedWork(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	l, ok, err := coord.Take(ctx, s.db, "site:s2:boot", "agent-1", 10*time.Second)
	require.NoError(t, err)
	require.True(t, ok)

	fenced, err := s.db.Begin(ctx)
	require.NoError(t, err)
	defer fenced.Rollback(ctx) //nolint:errcheck // after a commit, or when the test already failed, there is nothing to report
	require.NoError(t, coord.Fence(ctx, fenced, l))

	locked := make(chan error, 1)
	handover, err := s.db.Begin(ctx)
	require.NoError(t, err)
	defer handover.Rollback(ctx) //nolint:errcheck // after a commit, or when the test already failed, there is nothing to report
	go func() {
		_, err := coord.LockForHandover(ctx, handover, "site:s2:boot")
		locked <- err
	}()
	require.Eventually(t, func() bool { return waitersOn(t, s, "%FOR UPDATE%") == 1 }, 10*time.Second, 10*time.Millisecond,
		"the handover lock waits on the fenced transaction")
	require.NoError(t, fenced.Commit(ctx))
	require.NoError(t, <-locked)

	// Held: a renewal from another transaction waits until the handover ends.
	rctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	_, _, err = coord.Renew(rctx, s.db, l, 10*time.Second)
	require.Error(t, err, "a renewal waits for the handover lock")
	require.NoError(t, handover.Commit(ctx))
	_, ok, err = coord.Renew(ctx, s.db, l, 10*time.Second)
	require.NoError(t, err)
	require.True(t, ok)
}

// siteAgent registers a site agent of site in the nodes table.
func siteAgent(t *testing.T, s bundle, id, site string) {
	t.Helper()
	_, err := s.db.Exec(context.Background(), `INSERT INTO nodes (id, kind, site_id) VALUES ($1, 'site_agent', $2)`, id, site)
	require.NoError(t, err)
}

// vouch runs FenceSiteBootSQL in tx: whether agent holds its site's boot
// lease at epoch.
func vouch(t *testing.T, tx pgx.Tx, agent string, epoch int64) bool {
	t.Helper()
	var got int64
	err := tx.QueryRow(context.Background(), coord.FenceSiteBootSQL, agent, epoch).Scan(&got)
	if errors.Is(err, pgx.ErrNoRows) {
		return false
	}
	require.NoError(t, err)
	require.Equal(t, epoch, got)
	return true
}

// TestFenceSiteBootVouchesOnlyForTheHolderAtItsEpoch: the boot lease is
// named through the agent's nodes row; another epoch, another agent, an
// agent of another site, a plain node and an expired lease are refused.
func TestFenceSiteBootVouchesOnlyForTheHolderAtItsEpoch(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	siteAgent(t, s, "agent-1", "s1")
	siteAgent(t, s, "agent-2", "s1")
	siteAgent(t, s, "agent-9", "s9")
	_, err := s.db.Exec(ctx, `INSERT INTO nodes (id, kind) VALUES ('node-1', 'node')`)
	require.NoError(t, err)
	require.Equal(t, "site:s1:boot", coord.SiteBootLease("s1"))
	l, ok, err := coord.Take(ctx, s.db, coord.SiteBootLease("s1"), "agent-1", time.Second)
	require.NoError(t, err)
	require.True(t, ok)
	_, ok, err = coord.Take(ctx, s.db, "site:missing:boot", "node-1", time.Minute)
	require.NoError(t, err)
	require.True(t, ok)

	tx, err := s.db.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // after a commit, or when the test already failed, there is nothing to report
	require.True(t, vouch(t, tx, "agent-1", l.Epoch))
	require.False(t, vouch(t, tx, "agent-1", l.Epoch+1), "another epoch")
	require.False(t, vouch(t, tx, "agent-2", l.Epoch), "not the holder")
	require.False(t, vouch(t, tx, "agent-9", l.Epoch), "an agent of another site")
	require.False(t, vouch(t, tx, "node-1", l.Epoch), "not a site agent")
	require.NoError(t, tx.Commit(ctx))

	require.Eventually(t, func() bool {
		tx, err := s.db.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // after a commit, or when the test already failed, there is nothing to report
		return !vouch(t, tx, "agent-1", l.Epoch)
	}, 10*time.Second, 20*time.Millisecond, "an expired lease vouches for nobody")
}

// TestFenceSiteBootHoldsOffAPromotion: the vouch locks FOR KEY SHARE, as
// Fence does. A renewal passes it; the site boot reconciler's handover lock
// and a promotion of another agent (a new owner and epoch) wait until the
// report's transaction ends, which still sees the reported epoch current.
func TestFenceSiteBootHoldsOffAPromotion(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	siteAgent(t, s, "agent-1", "s1")
	name := coord.SiteBootLease("s1")
	l, ok, err := coord.Take(ctx, s.db, name, "agent-1", time.Second)
	require.NoError(t, err)
	require.True(t, ok)

	report, err := s.db.Begin(ctx)
	require.NoError(t, err)
	defer report.Rollback(ctx) //nolint:errcheck // after a commit, or when the test already failed, there is nothing to report
	require.True(t, vouch(t, report, "agent-1", l.Epoch))

	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, ok, err = coord.Renew(rctx, s.db, l, time.Second)
	require.NoError(t, err, "a renewal ends no holding and does not wait")
	require.True(t, ok)

	handover, err := s.db.Begin(ctx)
	require.NoError(t, err)
	defer handover.Rollback(ctx) //nolint:errcheck // after a commit, or when the test already failed, there is nothing to report
	locked := make(chan error, 1)
	go func() {
		_, err := coord.LockForHandover(ctx, handover, name)
		locked <- err
	}()
	require.Eventually(t, func() bool { return waitersOn(t, s, "%FOR UPDATE%") == 1 }, 10*time.Second, 10*time.Millisecond,
		"the reconciler's handover lock waits for the report")
	require.NoError(t, report.Commit(ctx))
	require.NoError(t, <-locked)
	require.NoError(t, handover.Rollback(ctx))

	// A report open when the lease runs out (no renewal meanwhile) holds
	// off the promotion of another agent, which raises the epoch.
	_, ok, err = coord.Renew(ctx, s.db, l, 2*time.Second)
	require.NoError(t, err)
	require.True(t, ok)
	report, err = s.db.Begin(ctx)
	require.NoError(t, err)
	defer report.Rollback(ctx) //nolint:errcheck // after a commit, or when the test already failed, there is nothing to report
	require.True(t, vouch(t, report, "agent-1", l.Epoch))
	require.Eventually(t, func() bool {
		var expired bool
		return s.db.QueryRow(ctx, `SELECT expires_at < compute_now() FROM leases WHERE name = $1`, name).Scan(&expired) == nil && expired
	}, 10*time.Second, 20*time.Millisecond)
	type take struct {
		l   coord.Lease
		ok  bool
		err error
	}
	taken := make(chan take, 1)
	go func() {
		l, ok, err := coord.Take(ctx, s.db, name, "agent-2", 10*time.Second)
		taken <- take{l, ok, err}
	}()
	require.Eventually(t, func() bool { return waitersOn(t, s, "%UPDATE leases%") == 1 }, 10*time.Second, 10*time.Millisecond,
		"the promotion waits for the report")
	select {
	case r := <-taken:
		t.Fatalf("the promotion did not wait for the report: %+v", r)
	default:
	}
	require.NoError(t, report.Commit(ctx))
	r := <-taken
	require.NoError(t, r.err)
	require.True(t, r.ok)
	require.Greater(t, r.l.Epoch, l.Epoch)
}
