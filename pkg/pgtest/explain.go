package pgtest

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/jackc/pgx/v5"
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
	p := Plan{ExecMs: out[0].ExecutionTime}
	num := func(n map[string]any, k string) int64 { f, _ := n[k].(float64); return int64(f) }
	p.Blocks = num(out[0].Plan, "Shared Hit Blocks") + num(out[0].Plan, "Shared Read Blocks")
	var walk func(n map[string]any)
	walk = func(n map[string]any) {
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
	walk(out[0].Plan)
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
