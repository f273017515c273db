package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
	"github.com/leasehold/leasehold/pkg/queue"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var fastArgs = []string{"--coord.lease-ttl", "3s", "--coord.renew-interval", "1s", "--coord.live-window", "6s",
	"--coord.statement-timeout", "1s", "--coord.self-release-after", "3s", "--coord.poll-interval", "50ms",
	"--placer.scan-interval", "500ms", "--coord.claim-ttl", "5s", "--log-format", "text"}

func startScheduler(t *testing.T, bin, id, dbURL string, extra ...string) *proctest.Proc {
	t.Helper()
	port, err := pglocal.FreePort()
	require.NoError(t, err)
	args := append(append([]string{"--id", id, "--database-url", dbURL, "--http-addr", fmt.Sprintf("127.0.0.1:%d", port)}, fastArgs...), extra...)
	args = append(args, pgtest.PoolerFlags(dbURL)...)
	p := proctest.Start(t, id, bin, nil, args...)
	p.WaitReady(20 * time.Second)
	return p
}

func seedPool(t *testing.T, db *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	_, err := db.Exec(ctx, "INSERT INTO pools (id) VALUES ('p1')")
	require.NoError(t, err)
	for i := range 20 {
		labels := `{}`
		if i < 15 {
			labels = `{"gpu": "a100"}`
		}
		_, err := db.Exec(ctx, "INSERT INTO nodes (id, state, pool_id, labels) VALUES ($1, 'connected', 'p1', $2)", fmt.Sprintf("node-%02d", i), labels)
		require.NoError(t, err)
	}
	_, err = db.Exec(ctx, `INSERT INTO pool_leases (id, pool_id, tenant, count, selector, created_at) VALUES
		('gpu-lease', 'p1', 'tenant-a', 10, '{"gpu": "a100"}', compute_now()),
		('any-lease', 'p1', 'tenant-b', 10, '{}', compute_now() + interval '1 millisecond')`)
	require.NoError(t, err)
	_, err = queue.Enqueue(ctx, db, "pool-placer", "p1", 0)
	require.NoError(t, err)
}

type allocation struct{ node, lease, by string }

func allocations(t *testing.T, db *pgxpool.Pool) []allocation {
	t.Helper()
	rows, err := db.Query(context.Background(), "SELECT node_id, pool_lease_id, placed_by FROM node_allocations ORDER BY node_id")
	require.NoError(t, err)
	defer rows.Close()
	var out []allocation
	for rows.Next() {
		var a allocation
		require.NoError(t, rows.Scan(&a.node, &a.lease, &a.by))
		out = append(out, a)
	}
	return out
}

func checkPlacement(t *testing.T, db *pgxpool.Pool) []allocation {
	t.Helper()
	allocs := allocations(t, db)
	require.Len(t, allocs, 20, "every node allocated")
	seen := map[string]bool{}
	perLease := map[string]int{}
	for _, a := range allocs {
		require.False(t, seen[a.node], "node %s allocated twice", a.node)
		seen[a.node] = true
		perLease[a.lease]++
	}
	require.Equal(t, map[string]int{"gpu-lease": 10, "any-lease": 10}, perLease)
	var wrong int
	require.NoError(t, db.QueryRow(context.Background(), `SELECT count(*) FROM node_allocations a JOIN nodes n ON n.id = a.node_id
		WHERE a.pool_lease_id = 'gpu-lease' AND NOT n.labels @> '{"gpu": "a100"}'`).Scan(&wrong))
	require.Zero(t, wrong, "the selector is honoured")
	return allocs
}

func TestPlacerAllocatesEveryLeaseOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	db := pgtest.NewDB(t)
	seedPool(t, db.Pool)
	startScheduler(t, proctest.Build(t, "."), "sa", db.URL)
	require.Eventually(t, func() bool {
		var n int
		_ = db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM pool_leases WHERE state = 'allocated'").Scan(&n)
		return n == 2
	}, 20*time.Second, 50*time.Millisecond)
	checkPlacement(t, db.Pool)
	var nodeShards int
	require.NoError(t, db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM leases WHERE name LIKE 'shard:%'").Scan(&nodeShards))
	require.Zero(t, nodeShards, "a scheduler-only process never takes node shards")
}

// TestPlacerFailoverMidPlacementAllocatesNoNodeTwice: the placer holding the
// pool's shard is paused in the middle of a placement; another scheduler
// takes the shard over and places everything; the paused one resumes and
// commits nothing.
func TestPlacerFailoverMidPlacementAllocatesNoNodeTwice(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	db := pgtest.NewDB(t)
	bin := proctest.Build(t, ".")
	a := startScheduler(t, bin, "sa", db.URL, "--placer.step-delay", "50ms")
	require.Eventually(t, func() bool {
		var n int
		_ = db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM leases WHERE owner = 'sa' AND name LIKE 'scheduler/shard:%'").Scan(&n)
		return n == 256
	}, 20*time.Second, 20*time.Millisecond)
	seedPool(t, db.Pool)
	// A is inside its placement transaction, between two allocations (20
	// steps of 50 ms: well inside the 3 s lease, so it would finish).
	require.Eventually(t, func() bool {
		var n int
		_ = db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = 'leasehold-scheduler:sa' AND state = 'idle in transaction'`).Scan(&n)
		return n > 0
	}, 20*time.Second, 5*time.Millisecond)
	a.Pause()
	startScheduler(t, bin, "sb", db.URL)
	require.Eventually(t, func() bool {
		var n int
		_ = db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM pool_leases WHERE state = 'allocated'").Scan(&n)
		return n == 2
	}, 30*time.Second, 50*time.Millisecond, "the survivor completes the placement")
	a.Resume()
	time.Sleep(3 * time.Second) // a window for the woken A to go on: what is checked is that nothing of it commits
	for _, al := range checkPlacement(t, db.Pool) {
		require.Equal(t, "sb", al.by, "nothing the paused placer did committed")
	}
}
