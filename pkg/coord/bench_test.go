package coord_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// BenchmarkAcquireMany renews 256 shard leases and 4 singletons in one
// statement: the cost of one membership pass's renewal.
func BenchmarkAcquireMany(b *testing.B) {
	db := pgtest.New(b)
	c, err := coord.NewClient(db, "bench-owner")
	require.NoError(b, err)
	ns := make([]string, 0, 260)
	for i := range 256 {
		ns = append(ns, fmt.Sprintf("shard:%d", i))
	}
	ns = append(ns, "singleton:sweeper", "singleton:janitor", "singleton:sink:events", "metrics:command-latency")
	ctx := context.Background()
	g, err := c.AcquireMany(ctx, ns, 15*time.Second)
	require.NoError(b, err)
	require.Len(b, g.Leases, 260)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		if _, err := c.AcquireMany(ctx, ns, 15*time.Second); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkFencedNoop is the fixed cost of a fenced transaction: begin,
// timeouts and fence in one round trip, commit.
func BenchmarkFencedNoop(b *testing.B) {
	db := pgtest.New(b)
	c, err := coord.NewClient(db, "bench-owner")
	require.NoError(b, err)
	ctx := context.Background()
	l, ok, err := c.Acquire(ctx, "shard:0", time.Hour)
	require.NoError(b, err)
	require.True(b, ok)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		if err := c.RunFenced(ctx, l, func(context.Context, pgx.Tx) error { return nil }); err != nil {
			b.Fatal(err)
		}
	}
}
