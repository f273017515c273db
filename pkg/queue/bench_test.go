package queue_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/queue"
)

// BenchmarkClaimComplete is one batch of a sharded reconciler: claim 100 due
// keys in one statement, then complete each in its own transaction fenced on
// its shard's lease (the run itself does nothing). The enqueue of the next
// batch is outside the timer.
func BenchmarkClaimComplete(b *testing.B) {
	const batch = 100
	db := pgtest.New(b)
	ctx := context.Background()
	c, err := coord.NewClient(db, "bench-worker")
	require.NoError(b, err)
	names := make([]string, coord.NumShards)
	shards := make([]int, coord.NumShards)
	for i := range names {
		names[i], shards[i] = fmt.Sprintf("shard:%d", i), i
	}
	g, err := c.AcquireMany(ctx, names, time.Hour)
	require.NoError(b, err)
	require.Len(b, g.Leases, coord.NumShards)
	leases := make(map[int]coord.Lease, coord.NumShards)
	for _, l := range g.Leases {
		var s int
		_, err := fmt.Sscanf(l.Name, "shard:%d", &s)
		require.NoError(b, err)
		leases[s] = l
	}
	keys := make([]string, batch)
	round := 0
	b.ReportAllocs()
	for b.Loop() {
		b.StopTimer()
		for i := range keys {
			keys[i] = fmt.Sprintf("node-%d-%d", round, i)
		}
		round++
		if _, err := queue.EnqueueMany(ctx, db, "node", keys, 0); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()

		items, err := queue.Claim(ctx, db, "node", c.Owner(), shards, batch, time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		if len(items) != batch {
			b.Fatalf("claimed %d of %d", len(items), batch)
		}
		for _, it := range items {
			err := c.RunFenced(ctx, leases[it.Shard], func(ctx context.Context, tx pgx.Tx) error {
				done, err := queue.Complete(ctx, tx, it)
				if err == nil && done != queue.Deleted {
					err = fmt.Errorf("completion %s", done)
				}
				return err
			})
			if err != nil {
				b.Fatal(err)
			}
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/key")
}
