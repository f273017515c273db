package gateway

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgtest"
)

// ingestTypes are ingestSQL's parameter types, in order.
var ingestTypes = []string{"text",
	"int[]", "text[]", "text[]", "text[]", "int[]", "bytea[]", "text[]", "timestamptz[]", "timestamptz[]", "bigint[]",
	"int[]", "text[]", "text[]",
	"int[]", "text[]", "text[]", "text[]", "text[]", "timestamptz[]", "bigint[]", "bigint[]",
	"int[]", "text[]", "text[]", "bigint[]", "text[]", "bytea[]", "bigint",
	"int[]", "text[]", "text[]", "text[]", "bool[]"}

// TestGroupCommitPlanIsLinearInTheBatch: the group commit runs from a
// generic plan (the gateway plans once per connection), which guesses ten
// rows for every array it unnests; a join or correlated EXISTS against
// the rows an update returned then becomes a nested loop over the batch for
// each item of the batch. With 1,000 results and 1,000 acks beside 10,000
// commands in flight, the rows the plan's nodes visit stay a small multiple
// of the batch, and every result and ack is written.
func TestGroupCommitPlanIsLinearInTheBatch(t *testing.T) {
	if testing.Short() {
		t.Skip("seeds 60,000 commands")
	}
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	registerNodes(t, db, "x", 300)
	_, err := db.Pool.Exec(ctx, `
INSERT INTO commands (node_id, kind, state, finished_at) SELECT 'x-' || (i % 300), 'k', 'succeeded', compute_now() FROM generate_series(1, 50000) i;
INSERT INTO commands (id, node_id, kind, state) SELECT 'c' || i, 'x-' || (i % 300), 'k', 'dispatched' FROM generate_series(1, 10000) i;
ANALYZE`)
	require.NoError(t, err)

	const n = 1000
	var rI, rNode, rID, rCmd, rExit, rOut, rErr, rTime, rEpoch, aI, aNode, aCmd []string
	for i := 1; i <= n; i++ {
		rI, rNode, rID, rCmd = append(rI, fmt.Sprint(i-1)), append(rNode, fmt.Sprint("x-", i%300)), append(rID, fmt.Sprint("r", i)), append(rCmd, fmt.Sprint("c", i))
		rExit, rOut, rErr, rTime, rEpoch = append(rExit, "0"), append(rOut, `"\\x6f6b"`), append(rErr, `""`), append(rTime, "NULL"), append(rEpoch, "1")
		j := n + i
		aI, aNode, aCmd = append(aI, fmt.Sprint(n+i-1)), append(aNode, fmt.Sprint("x-", j%300)), append(aCmd, fmt.Sprint("c", j))
	}
	arr := func(v []string) string { return "'{" + strings.Join(v, ",") + "}'" }
	literals := []string{"'gw'", arr(rI), arr(rNode), arr(rID), arr(rCmd), arr(rExit), arr(rOut), arr(rErr), arr(rTime), arr(rTime), arr(rEpoch),
		arr(aI), arr(aNode), arr(aCmd)}
	for range 8 { // events
		literals = append(literals, "'{}'")
	}
	literals = append(literals, "'{}'", "'{}'", "'{}'", "'{}'", "'{}'", "'{}'", "1048576") // output pieces and the cap
	literals = append(literals, "'{}'", "'{}'", "'{}'", "'{}'", "'{}'")                    // cancel acks, truncation flags
	p := pgtest.ExplainGeneric(t, db.Pool, ingestSQL, ingestTypes, literals)
	bound := int64(40 * 2 * n)
	t.Logf("group commit of %d results and %d acks: %d rows visited (bound %d), %d buffers, %.1f ms", n, n, p.RowsVisited, bound, p.Blocks, p.ExecMs)
	require.LessOrEqual(t, p.RowsVisited, bound, "the plan's work follows the batch, not its square")
	var stored, acked int
	require.NoError(t, db.Pool.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE result_id IS NOT NULL AND state = 'succeeded'),
       count(*) FILTER (WHERE acked_at IS NOT NULL AND state = 'dispatched')
  FROM commands`).Scan(&stored, &acked))
	require.Equal(t, n, stored)
	require.Equal(t, n, acked)
}
