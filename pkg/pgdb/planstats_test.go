package pgdb_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestRefreshPlanStatsReplansAGrownTable: a generic plan made while its
// table is empty joins a batch to the table by scanning all of it, and keeps
// that plan as the table grows; one RefreshPlanStats pass analyzes the table
// and the same prepared statement is planned again with an index scan. A
// second pass finds nothing to do. The control is the statement on a second
// connection whose plan is looked at before the pass: still the scan.
func TestRefreshPlanStatsReplansAGrownTable(t *testing.T) {
	t.Parallel()
	if pgtest.Pooled() {
		t.Skip("generic plans are per server connection; a transaction-mode pooler does not keep them")
	}
	db := pgtest.NewDB(t)
	ctx := context.Background()
	pool, err := pgdb.Connect(ctx, pgdb.Config{URL: db.URL, GenericPlans: true, MaxConns: 4})
	require.NoError(t, err)
	defer pool.Close()
	_, err = pool.Exec(ctx, `CREATE TABLE plan_grow (id text PRIMARY KEY, v int NOT NULL)`)
	require.NoError(t, err)

	const stmt = `SELECT count(*) FROM unnest($1::text[]) AS b(id) JOIN plan_grow g ON g.id = b.id`
	prepare := func() *pgxpool.Conn {
		conn, err := pool.Acquire(ctx)
		require.NoError(t, err)
		_, err = conn.Exec(ctx, "PREPARE grow(text[]) AS "+stmt)
		require.NoError(t, err)
		return conn
	}
	scans := func(conn *pgxpool.Conn) map[string]bool {
		var raw []byte
		require.NoError(t, conn.QueryRow(ctx, `EXPLAIN (FORMAT JSON) EXECUTE grow('{a,b}')`).Scan(&raw))
		var out []struct{ Plan map[string]any }
		require.NoError(t, json.Unmarshal(raw, &out))
		found := map[string]bool{}
		var walk func(n map[string]any)
		walk = func(n map[string]any) {
			if n["Relation Name"] == "plan_grow" {
				found[n["Node Type"].(string)] = true
			}
			kids, _ := n["Plans"].([]any)
			for _, k := range kids {
				walk(k.(map[string]any))
			}
		}
		walk(out[0].Plan)
		return found
	}
	planned, control := prepare(), prepare()
	defer planned.Release()
	defer control.Release()
	require.True(t, scans(planned)["Seq Scan"], "the premise: an empty, never analyzed table is planned as a scan")
	require.True(t, scans(control)["Seq Scan"])

	_, err = pool.Exec(ctx, `INSERT INTO plan_grow SELECT 'n' || i, i FROM generate_series(1, 50000) i`)
	require.NoError(t, err)
	require.True(t, scans(control)["Seq Scan"], "growth alone does not replan a generic plan")

	// The statistics system counts the insert once the inserting backend
	// reports it (at most a second later): the pass is repeated until it
	// sees the rows, and its answer is the signal.
	var done []pgdb.StaleTable
	deadline := time.Now().Add(30 * time.Second)
	for len(done) == 0 {
		require.True(t, time.Now().Before(deadline), "no pass saw the 50,000 rows within 30 s")
		done, err = pgdb.RefreshPlanStats(ctx, pool, pgdb.PlanStatsMinRows, pgdb.PlanStatsGrowth)
		require.NoError(t, err)
		if len(done) == 0 {
			time.Sleep(100 * time.Millisecond) // waiting for the statistics system's report, not for time
		}
	}
	require.Equal(t, []pgdb.StaleTable{{Name: "plan_grow", PlannedRows: 0, LiveRows: 50000}}, done)

	got := scans(planned)
	require.True(t, got["Index Scan"] || got["Index Only Scan"], "after the pass the cached statement is planned again with the primary key: %v", got)
	require.False(t, got["Seq Scan"], fmt.Sprint(got))

	again, err := pgdb.RefreshPlanStats(ctx, pool, pgdb.PlanStatsMinRows, pgdb.PlanStatsGrowth)
	require.NoError(t, err)
	require.Empty(t, again, "statistics within the growth factor are left alone")
}
