package coord_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jonboulle/clockwork"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// leaseSnapshot is what a backup holds of the lease state: the rows, the
// count of grants and the restore generation. restore writes it back, as
// restoring the backup into the live database would (the doctor's
// TestRestoredDumpReusesNoEpoch restores a real pg_dump).
type leaseSnapshot struct {
	rows []leaseRow
	last int64
	call bool
	gen  int64
}

type leaseRow struct {
	name       string
	owner      *string
	epoch      int64
	expiresAt  time.Time
	acquiredAt *time.Time
}

func snapshotLeases(t *testing.T, db *pgxpool.Pool) leaseSnapshot {
	t.Helper()
	ctx := context.Background()
	var s leaseSnapshot
	rows, err := db.Query(ctx, `SELECT name, owner, epoch, expires_at, acquired_at FROM leases`)
	require.NoError(t, err)
	s.rows, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (leaseRow, error) {
		var l leaseRow
		return l, r.Scan(&l.name, &l.owner, &l.epoch, &l.expiresAt, &l.acquiredAt)
	})
	require.NoError(t, err)
	require.NoError(t, db.QueryRow(ctx, `SELECT last_value, is_called FROM lease_grants`).Scan(&s.last, &s.call))
	require.NoError(t, db.QueryRow(ctx, `SELECT generation FROM leasehold_instance`).Scan(&s.gen))
	return s
}

func (s leaseSnapshot) restore(t *testing.T, db *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, pgdb.InTx(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `DELETE FROM leases`); err != nil {
			return err
		}
		for _, r := range s.rows {
			if _, err := tx.Exec(ctx, `INSERT INTO leases (name, owner, epoch, expires_at, acquired_at) VALUES ($1, $2, $3, $4, $5)`,
				r.name, r.owner, r.epoch, r.expiresAt, r.acquiredAt); err != nil {
				return err
			}
		}
		if _, err := tx.Exec(ctx, `SELECT setval('lease_grants', $1, $2)`, s.last, s.call); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `UPDATE leasehold_instance SET generation = $1`, s.gen)
		return err
	}))
}

type regressions struct {
	mu   sync.Mutex
	seen []coord.Regression
}

func (r *regressions) observe(reg coord.Regression) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seen = append(r.seen, reg)
}

func (r *regressions) all() []coord.Regression {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]coord.Regression(nil), r.seen...)
}

func acquireOne(t *testing.T, c *coord.Client, name string) (coord.Lease, bool) {
	t.Helper()
	l, ok, err := c.Acquire(context.Background(), name, time.Minute)
	require.NoError(t, err)
	return l, ok
}

// TestAcquireAfterARestoreReusesNoEpoch: three live processes; the lease
// state goes back to a snapshot taken before a lease changed hands twice.
// A process that never held that lease, but renewed after the last change,
// takes it first: its statement finds fewer grants than it saw, grants
// nothing, records the regression and raises the generation, and the lease
// comes back at an epoch above every epoch handed out before. Before
// migration 00030 it got epoch 2 again.
func TestAcquireAfterARestoreReusesNoEpoch(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	var regs regressions
	client := func(owner string) *coord.Client {
		c, err := coord.NewClient(db, owner, coord.WithRegressionObserver(regs.observe))
		require.NoError(t, err)
		return c
	}
	a, b, c := client("w-a"), client("w-b"), client("w-c")

	_, ok := acquireOne(t, a, "singleton:x")
	require.True(t, ok)
	y1, ok := acquireOne(t, b, "singleton:y")
	require.True(t, ok)
	_, ok = acquireOne(t, c, "singleton:z")
	require.True(t, ok)
	backup := snapshotLeases(t, db)

	// y changes hands twice after the backup.
	handedOut := []int64{y1.Epoch}
	_, err := b.Release(ctx, "singleton:y")
	require.NoError(t, err)
	y2, ok := acquireOne(t, a, "singleton:y")
	require.True(t, ok)
	_, err = a.Release(ctx, "singleton:y")
	require.NoError(t, err)
	y3, ok := acquireOne(t, b, "singleton:y")
	require.True(t, ok)
	handedOut = append(handedOut, y2.Epoch, y3.Epoch)
	require.Equal(t, []int64{1, 2, 3}, handedOut)
	// Everyone renews: every process has seen the latest count.
	for _, p := range []*coord.Client{a, b, c} {
		_, err := p.AcquireMany(ctx, []string{"singleton:x", "singleton:y", "singleton:z"}, time.Minute)
		require.NoError(t, err)
	}

	backup.restore(t, db)
	_, err = db.Exec(ctx, `UPDATE leases SET expires_at = '-infinity' WHERE name = 'singleton:y'`)
	require.NoError(t, err)

	y4, ok := acquireOne(t, c, "singleton:y")
	require.True(t, ok)
	for _, e := range handedOut {
		require.Greater(t, y4.Epoch, e, "an epoch handed out before the restore is never handed out again")
	}
	require.EqualValues(t, 1, coord.Generation(y4.Floor), "the first detection raised the generation")
	require.Equal(t, y4.Floor+1, y4.Epoch)

	got := regs.all()
	require.Len(t, got, 1)
	require.Equal(t, "w-c", got[0].DetectedBy)
	require.Greater(t, got[0].SeenGrants, got[0].FoundGrants)
	require.Empty(t, got[0].Leases, "w-c never held y: the count of grants told it")
	require.EqualValues(t, 1, got[0].RaisedTo)

	// x was not touched after the backup: its holder keeps it at its epoch,
	// which was never handed out to anyone else.
	x, ok := acquireOne(t, a, "singleton:x")
	require.True(t, ok)
	require.EqualValues(t, 1, x.Epoch)
	// b held y at 3: it does not get y back (c holds it) and records nothing.
	_, ok = acquireOne(t, b, "singleton:y")
	require.False(t, ok)
	require.Len(t, regs.all(), 1)

	var n int
	var raised *int64
	require.NoError(t, db.QueryRow(ctx, `SELECT count(*), max(raised_generation) FROM epoch_regressions WHERE detected_by = 'w-c' AND acknowledged_at IS NULL`).Scan(&n, &raised))
	require.Equal(t, 1, n)
	require.NotNil(t, raised)
	require.EqualValues(t, 1, *raised)
}

// TestKeeperAfterARestoreTakesAboveWhatItHeld is about logic, on an injected
// clock: a keeper held its lease at epochs 1, 2 and 3; the lease state goes
// back to the snapshot taken at epoch 1, where the row still names the
// keeper as the live owner. The renewal at 3 finds no such holding, and the
// take finds the row below the epoch the keeper held: it records the
// regression, and the new holding is above epoch 3.
func TestKeeperAfterARestoreTakesAboveWhatItHeld(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	clock := clockwork.NewFakeClock()
	var regs regressions
	client, err := coord.NewClient(db, "gw-r", coord.WithClock(clock), coord.WithRegressionObserver(regs.observe))
	require.NoError(t, err)
	ev := newKeeperEvents()
	k, err := coord.NewKeeper(client, ev.config("gateway:gw-r", time.Hour, time.Minute, 10*time.Minute), nil)
	require.NoError(t, err)
	runKeeper(t, k)
	require.NoError(t, clock.BlockUntilContext(context.Background(), 1))

	first := receive(t, ev.acquired, "the first take")
	require.EqualValues(t, 1, first.Epoch)
	backup := snapshotLeases(t, db)

	epochs := []int64{first.Epoch}
	for range 2 {
		k.Drop("test: start a new holding")
		receive(t, ev.lost, "the drop")
		l := receiveAdvancing(t, clock, ev.acquired, "the take after the drop")
		epochs = append(epochs, l.Epoch)
	}
	require.Equal(t, []int64{1, 2, 3}, epochs)

	backup.restore(t, db)
	require.Contains(t, receiveAdvancing(t, clock, ev.lost, "the loss at the renewal"), "at another epoch")
	after := receiveAdvancing(t, clock, ev.acquired, "the take after the restore")
	require.Greater(t, after.Epoch, epochs[len(epochs)-1])
	require.EqualValues(t, 1, coord.Generation(after.Floor))

	got := regs.all()
	require.Len(t, got, 1)
	require.Equal(t, []coord.LeaseBehind{{Name: "gateway:gw-r", Seen: 3, Found: 1}}, got[0].Leases)
	l, ok := k.Current()
	require.True(t, ok)
	require.Equal(t, after.Epoch, l.Epoch)
}

// receiveAdvancing advances the fake clock five seconds at a time until ch
// yields.
func receiveAdvancing[T any](t *testing.T, clock *clockwork.FakeClock, ch <-chan T, what string) T {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for {
		select {
		case v := <-ch:
			return v
		case <-deadline:
			t.Fatalf("timed out waiting for %s", what)
		case <-time.After(20 * time.Millisecond):
			clock.Advance(5 * time.Second)
		}
	}
}
