package coord_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// statementCalls sums pg_stat_statements calls in db's database of the
// statements whose text matches each pattern (a PostgreSQL regular
// expression).
func statementCalls(t *testing.T, db *pgtest.DB, markers ...string) []int64 {
	t.Helper()
	out := make([]int64, len(markers))
	for i, m := range markers {
		require.NoError(t, db.Pool.QueryRow(context.Background(), `
SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements
 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND query ~ $1 AND strpos(query, 'pg_stat_statements') = 0`, m).Scan(&out[i]))
	}
	return out
}

// TestOnePassOneGrantStatement: in steady state a worker holding all 256
// controller shards renews them with one statement per membership pass,
// not one per lease: over several passes the grant statement (the one that
// writes leases) is called as often as the heartbeat (one per pass), and
// nothing else touches the leases table.
func TestOnePassOneGrantStatement(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	if _, err := db.Pool.Exec(context.Background(), `CREATE EXTENSION IF NOT EXISTS pg_stat_statements`); err != nil {
		t.Skipf("pg_stat_statements is not available on this server (pkg/pglocal preloads it): %v", err)
	}
	r := startRenewer(t, db, "w-cost", false, []coord.Group{coord.Controllers})
	require.Eventually(t, holdsAll(r), 30*time.Second, 10*time.Millisecond)

	// The leases table as a word: the heartbeat's leases_held column is not it.
	const heartbeat, leases = `INSERT INTO workers`, `\mleases\M`
	before := statementCalls(t, db, heartbeat, leases)
	require.Eventually(t, func() bool {
		now := statementCalls(t, db, heartbeat, leases)
		return now[0]-before[0] >= 4
	}, 30*time.Second, 50*time.Millisecond, "four passes")
	after := statementCalls(t, db, heartbeat, leases)
	passes, grants := after[0]-before[0], after[1]-before[1]
	t.Logf("%d passes, %d statements on leases, %d shards held", passes, grants, len(r.Shards(coord.Controllers)))
	// A pass in flight at either read may be counted on one side only.
	require.InDelta(t, passes, grants, 1, "one leases statement per pass for %d leases", coord.NumShards)
}
