package coord_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestNotReadyWhileHoldingNoneOfItsPlannedShards: a worker whose every
// planned shard is held by someone else (here a process that is not a
// member, holding them for a minute) passes its membership passes but is
// not ready, saying why; once the shards are released it takes them and
// is ready.
func TestNotReadyWhileHoldingNoneOfItsPlannedShards(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	squatter, err := coord.NewClient(db.Pool, "squatter")
	require.NoError(t, err)
	names := make([]string, coord.NumShards)
	for i := range names {
		names[i] = coord.Controllers.ShardLease(i)
	}
	g, err := squatter.AcquireMany(ctx, names, time.Minute)
	require.NoError(t, err)
	for _, n := range names {
		_, ok := g.Get(n)
		require.True(t, ok, "the squatter holds %s", n)
	}

	r := startRenewer(t, db, "w-ready", false, []coord.Group{coord.Controllers})
	var why error
	require.Eventually(t, func() bool {
		why = r.Ready()
		return why != nil && why.Error() == "holds none of the 256 shards of group controllers planned for it"
	}, 30*time.Second, 10*time.Millisecond, "after a pass, not ready for the right reason (last: %v)", why)
	require.Empty(t, r.Shards(coord.Controllers))

	_, err = squatter.Release(ctx, names...)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return r.Ready() == nil }, 30*time.Second, 10*time.Millisecond, "ready once it holds its shards")
	require.NotEmpty(t, r.Shards(coord.Controllers))
}
