package coord_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestFencedTransactionDoesNotCommitPastValidity: a holder whose process
// clock passes the lease's validity between the fence and the commit (a
// process paused there wakes up so) has its writes rolled back and is told
// the lease is lost, on both of RunFenced's paths: its own transaction and
// a savepoint of the caller's. The clock is injected and the context's
// deadline is a minute away, so only the check before COMMIT can stop it.
func TestFencedTransactionDoesNotCommitPastValidity(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	createLog(t, db.Pool)
	c, err := coord.NewClient(db.Pool, "owner-a")
	require.NoError(t, err)
	l, ok, err := c.Acquire(ctx, "singleton:commit-past-validity", 2*time.Minute)
	require.NoError(t, err)
	require.True(t, ok)

	now := l.ValidUntil.Add(-time.Minute)
	opts := coord.FenceOptions{Now: func() time.Time { return now }}
	write := func(note string) func(ctx context.Context, tx pgx.Tx) error {
		return func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO fenced_log VALUES ('a', $1, $2)", l.Epoch, note)
			return err
		}
	}
	require.NoError(t, coord.RunFenced(ctx, db.Pool, l, opts, write("in time")))
	require.Equal(t, 1, countLog(t, db.Pool, "a"))

	paused := func(note string) func(ctx context.Context, tx pgx.Tx) error {
		return func(ctx context.Context, tx pgx.Tx) error {
			err := write(note)(ctx, tx)
			now = l.ValidUntil // paused here until the validity ran out
			return err
		}
	}
	err = coord.RunFenced(ctx, db.Pool, l, opts, paused("woke past validity"))
	require.ErrorIs(t, err, coord.ErrLeaseLost)
	require.Equal(t, 1, countLog(t, db.Pool, "a"), "the late transaction committed")

	now = l.ValidUntil.Add(-time.Minute)
	err = pgdb.InTx(ctx, db.Pool, func(outer pgx.Tx) error {
		err := coord.RunFenced(ctx, outer, l, opts, paused("savepoint woke past validity"))
		require.ErrorIs(t, err, coord.ErrLeaseLost)
		_, err = outer.Exec(ctx, "INSERT INTO fenced_log VALUES ('outer', 0, 'after the savepoint')")
		return err
	})
	require.NoError(t, err)
	require.Equal(t, 1, countLog(t, db.Pool, "a"), "the late savepoint was kept")
	require.Equal(t, 1, countLog(t, db.Pool, "outer"))
}
