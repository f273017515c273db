package pgtest_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/migrations"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestEachTestGetsAFreshMigratedDatabase(t *testing.T) {
	t.Parallel()
	a, b := pgtest.NewDB(t), pgtest.NewDB(t)
	require.NotEqual(t, a.Name, b.Name)
	ctx := context.Background()
	_, err := a.Pool.Exec(ctx, "INSERT INTO leases (name) VALUES ('only-in-a')")
	require.NoError(t, err)
	var n int
	require.NoError(t, b.Pool.QueryRow(ctx, "SELECT count(*) FROM leases").Scan(&n))
	require.Zero(t, n, "databases are isolated")
	var fn string
	require.NoError(t, b.Pool.QueryRow(ctx, "SELECT proname FROM pg_proc WHERE proname = 'compute_now'").Scan(&fn))
	require.Equal(t, "compute_now", fn)
}

func TestMigrationsApplyToEmptyDatabaseAndAreIdempotent(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmpty(t)
	ctx := context.Background()
	st, err := migrations.UpURL(ctx, db.URL, nil)
	require.NoError(t, err)
	require.Zero(t, st.Pending)
	require.Equal(t, st.Target, st.Current)
	again, err := migrations.UpURL(ctx, db.URL, nil)
	require.NoError(t, err)
	require.Equal(t, st, again)
}

func TestDatabaseNewerThanBinaryIsRefused(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, "INSERT INTO goose_db_version (version_id, is_applied) VALUES (99999, true)")
	require.NoError(t, err)
	sqlDB, err := migrations.Open(db.URL)
	require.NoError(t, err)
	defer sqlDB.Close()
	_, err = migrations.Check(ctx, sqlDB)
	require.ErrorIs(t, err, migrations.ErrDatabaseNewer)
	require.Contains(t, err.Error(), "database is at version 99999")
	_, err = migrations.Up(ctx, sqlDB, nil)
	require.ErrorIs(t, err, migrations.ErrDatabaseNewer)
}

// TestPgBouncerModeURLsAndFlags: in a PgBouncer mode the pool and URL go
// through PgBouncer (which reports itself in SHOW-less ways: a different
// port than the server's) and the flags for services follow the mode.
func TestPgBouncerModeURLsAndFlags(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	switch pgtest.Mode() {
	case pgtest.ModeDirect:
		require.Equal(t, db.URL, db.DirectURL)
		require.Empty(t, pgtest.PoolerFlags(db.URL))
		return
	case pgtest.ModeListen:
		require.NotEmpty(t, db.DirectURL)
		require.NotEqual(t, db.URL, db.DirectURL)
		require.Equal(t, []string{"--pooler", "--listen-database-url", db.DirectURL}, pgtest.PoolerFlags(db.URL))
	case pgtest.ModeNoListen:
		require.Empty(t, db.DirectURL)
		require.Equal(t, []string{"--pooler"}, pgtest.PoolerFlags(db.URL))
	}
	require.NotNil(t, pgtest.Server(t).PgBouncer())
	require.Contains(t, db.URL, pgtest.Server(t).PgBouncer().Addr())
	var n int
	require.NoError(t, db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM leases").Scan(&n))
}
