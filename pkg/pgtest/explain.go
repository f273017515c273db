package pgtest

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

// Plan is what EXPLAIN (ANALYZE, BUFFERS) reported of one statement: the
// figures a test about a statement's cost asserts. Buffers, not times, are
// what such a test should compare: they do not depend on how busy the
// machine is.
type Plan struct {
	// Blocks is the shared buffers the whole statement hit or read.
	Blocks int64
	// ExecMs is the execution time, for logs only.
	ExecMs float64
	// SortOnDisk is true when some node of the plan sorted on disk.
	SortOnDisk bool
	// SeqScans names the relations some node read by a sequential scan.
	SeqScans []string
	// RowsVisited is the rows every node of the plan produced, times its
	// loops, summed: a statement whose work is linear in its input keeps
	// it a small multiple of the input; a nested loop over a batch for
	// each row of the batch makes it quadratic.
	RowsVisited int64
}

// Explain runs sql with args under EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)
// on q. ANALYZE executes the statement: run a write inside a transaction
// the test rolls back.
func Explain(t testing.TB, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, sql string, args ...any) Plan {
	t.Helper()
	var raw []byte
	require.NoError(t, q.QueryRow(context.Background(), "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+sql, args...).Scan(&raw))
	var out []struct {
		Plan          map[string]any `json:"Plan"`
		ExecutionTime float64        `json:"Execution Time"`
	}
	require.NoError(t, json.Unmarshal(raw, &out))
	require.Len(t, out, 1)
	return planOf(out[0].Plan, out[0].ExecutionTime)
}

// ExplainGeneric is Explain of sql as PostgreSQL runs it from a generic
// plan (plan_cache_mode = force_generic_plan), the way a process that plans
// once per connection runs it: sql is prepared with the parameter types
// types and executed under EXPLAIN with literals, SQL literals of those
// types (EXPLAIN EXECUTE takes no protocol parameters). Generic plans know
// nothing of the arguments (every array and set-returning function is
// guessed at ten rows), which is what a test of such a statement must
// face. It uses a connection of its own from pool and runs the statement
// for real.
func ExplainGeneric(t testing.TB, pool interface {
	Acquire(context.Context) (*pgxpool.Conn, error)
}, sql string, types, literals []string) Plan {
	t.Helper()
	require.Len(t, literals, len(types))
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, "SET plan_cache_mode = force_generic_plan")
	require.NoError(t, err)
	defer func() { _, _ = conn.Exec(ctx, "DEALLOCATE pgtest_generic; RESET plan_cache_mode") }()
	_, err = conn.Exec(ctx, "PREPARE pgtest_generic("+strings.Join(types, ", ")+") AS "+sql)
	require.NoError(t, err)
	var raw []byte
	require.NoError(t, conn.QueryRow(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE pgtest_generic("+strings.Join(literals, ", ")+")").Scan(&raw))
	var out []struct {
		Plan          map[string]any `json:"Plan"`
		ExecutionTime float64        `json:"Execution Time"`
	}
	require.NoError(t, json.Unmarshal(raw, &out))
	require.Len(t, out, 1)
	return planOf(out[0].Plan, out[0].ExecutionTime)
}

// planOf reads a Plan from the root node of EXPLAIN's JSON.
func planOf(root map[string]any, execMs float64) Plan {
	p := Plan{ExecMs: execMs}
	num := func(n map[string]any, k string) int64 { f, _ := n[k].(float64); return int64(f) }
	p.Blocks = num(root, "Shared Hit Blocks") + num(root, "Shared Read Blocks")
	var walk func(n map[string]any)
	walk = func(n map[string]any) {
		p.RowsVisited += num(n, "Actual Rows") * max(num(n, "Actual Loops"), 1)
		if n["Sort Space Type"] == "Disk" {
			p.SortOnDisk = true
		}
		if n["Node Type"] == "Seq Scan" {
			rel, _ := n["Relation Name"].(string)
			p.SeqScans = append(p.SeqScans, rel)
		}
		kids, _ := n["Plans"].([]any)
		for _, k := range kids {
			walk(k.(map[string]any))
		}
	}
	walk(root)
	return p
}

// ExplainWithout is Explain of sql as it ran before index existed: inside a
// transaction that drops index and is rolled back, so the statement's plan
// (and any write it makes) leaves nothing behind. Cost tests use it to show
// that their bound tells the plan without the index apart.
func ExplainWithout(t testing.TB, db interface {
	Begin(context.Context) (pgx.Tx, error)
}, index, sql string, args ...any) Plan {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // only measured
	_, err = tx.Exec(ctx, "DROP INDEX "+pgx.Identifier{index}.Sanitize())
	require.NoError(t, err)
	return Explain(t, tx, sql, args...)
}
