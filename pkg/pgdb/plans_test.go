package pgdb_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestGenericPlansPlanOncePerConnection: with GenericPlans a cached
// statement taking an array is planned generically from its first call and
// never re-planned; behind a transaction-mode pooler the option is left
// out, so the pooler does not refuse the connection.
func TestGenericPlansPlanOncePerConnection(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	pool, err := pgdb.Connect(ctx, pgdb.Config{URL: db.URL, GenericPlans: true, Pooler: pgtest.Pooled(), MaxConns: 1})
	require.NoError(t, err)
	defer pool.Close()
	var mode string
	require.NoError(t, pool.QueryRow(ctx, "SHOW plan_cache_mode").Scan(&mode))
	if pgtest.Pooled() {
		require.Equal(t, "auto", mode, "not sent through the pooler")
		return
	}
	require.Equal(t, "force_generic_plan", mode)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	const q = `SELECT count(*) FROM unnest($1::text[]) AS u(x) JOIN pg_class c ON c.relname = u.x`
	for range 8 {
		var n int
		require.NoError(t, conn.QueryRow(ctx, q, []string{"pg_class", "pg_type"}).Scan(&n))
		require.Equal(t, 2, n)
	}
	var generic, custom int64
	require.NoError(t, conn.QueryRow(ctx,
		`SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1`, q).Scan(&generic, &custom))
	require.EqualValues(t, 8, generic)
	require.Zero(t, custom)
}
