package coord_test

import (
	"context"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

var fastTimings = coord.Timings{LeaseTTL: 3 * time.Second, Renew: time.Second, LiveWindow: 6 * time.Second, ForgetAfter: time.Minute}

func startRenewer(t *testing.T, db *pgtest.DB, id string, notify bool, groups []coord.Group, singletons ...string) *coord.Renewer {
	t.Helper()
	c, err := coord.NewClient(db.Pool, id)
	require.NoError(t, err)
	url := ""
	if notify {
		url = db.DirectURL // LISTEN needs a session: never through PgBouncer
	}
	r, err := coord.NewRenewer(coord.RenewerConfig{Groups: groups, Singletons: singletons, Timings: fastTimings, NotifyURL: url},
		c, nil, prometheus.NewRegistry(), nil)
	require.NoError(t, err)
	require.NoError(t, services.StartAndAwaitRunning(context.Background(), r))
	t.Cleanup(func() { _ = services.StopAndAwaitTerminated(context.Background(), r) })
	return r
}

// settled reports whether each renewer holds exactly the shards rendezvous
// hashing assigns it among ids (ids[i] is rs[i]'s id).
func settled(ids []string, rs ...*coord.Renewer) func() bool {
	return func() bool {
		want := coord.Assign(ids)
		for i, r := range rs {
			n := 0
			for _, s := range r.Shards(coord.Controllers) {
				if want[s] != ids[i] {
					return false
				}
				n++
			}
			exp := 0
			for _, o := range want {
				if o == ids[i] {
					exp++
				}
			}
			if n != exp {
				return false
			}
		}
		return true
	}
}

func holdsAll(rs ...*coord.Renewer) func() bool {
	return func() bool {
		seen := map[int]int{}
		for _, r := range rs {
			for _, s := range r.Shards(coord.Controllers) {
				seen[s]++
			}
		}
		if len(seen) != coord.NumShards {
			return false
		}
		for _, n := range seen {
			if n != 1 {
				return false
			}
		}
		return true
	}
}

func TestRenewersSplitShardsByRendezvous(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	a := startRenewer(t, db, "wa", true, []coord.Group{coord.Controllers}, "singleton:sweeper")
	b := startRenewer(t, db, "wb", true, []coord.Group{coord.Controllers}, "singleton:sweeper")
	require.Eventually(t, func() bool {
		if !holdsAll(a, b)() {
			return false
		}
		want := coord.Assign([]string{"wa", "wb"})
		for _, s := range a.Shards(coord.Controllers) {
			if want[s] != "wa" {
				return false
			}
		}
		return len(a.Shards(coord.Controllers)) > 0 && len(b.Shards(coord.Controllers)) > 0
	}, 15*time.Second, 20*time.Millisecond, "shards settle on their rendezvous owners")

	_, aHas := a.Lease("singleton:sweeper")
	_, bHas := b.Lease("singleton:sweeper")
	require.True(t, aHas != bHas, "the singleton is held by exactly one member")

	// The database agrees: every shard row is held by its rendezvous owner.
	var wrong int
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		"SELECT count(*) FROM leases WHERE name LIKE 'shard:%' AND owner IS NULL").Scan(&wrong))
	require.Zero(t, wrong)
	var members int
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		"SELECT count(*) FROM workers WHERE member_group = 'controllers'").Scan(&members))
	require.Equal(t, 2, members)
}

func TestSingletonOnlyProcessHoldsNoShards(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	r := startRenewer(t, db, "solo", true, nil, "singleton:janitor")
	require.Eventually(t, func() bool { _, ok := r.Lease("singleton:janitor"); return ok }, 10*time.Second, 20*time.Millisecond)
	var shards int
	require.NoError(t, db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM leases WHERE name LIKE '%shard:%'").Scan(&shards))
	require.Zero(t, shards)
	var group string
	require.NoError(t, db.Pool.QueryRow(context.Background(), "SELECT member_group FROM workers WHERE id = 'singletons/solo'").Scan(&group))
	require.Equal(t, "singletons", group)
}

func TestSchedulerGroupTakesOnlySchedulerShards(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	r := startRenewer(t, db, "sched", true, []coord.Group{coord.Scheduler})
	require.Eventually(t, func() bool { return len(r.Shards(coord.Scheduler)) == coord.NumShards }, 10*time.Second, 20*time.Millisecond)
	require.Empty(t, r.Shards(coord.Controllers))
	var nodeShards int
	require.NoError(t, db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM leases WHERE name LIKE 'shard:%'").Scan(&nodeShards))
	require.Zero(t, nodeShards, "a scheduler-only process never takes node shards")
}

// TestStopHandsOverWellUnderARenewalPeriod: a member stopped gracefully
// releases and leaves; through NOTIFY the survivor holds everything long
// before its next periodic pass (Renew = 1 s here).
// TestNewMemberTakesItsShareAndOthersLetGo: adding a member moves only the
// shards rendezvous hashing gives it.
func TestNewMemberTakesItsShareAndOthersLetGo(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	a := startRenewer(t, db, "wa", true, []coord.Group{coord.Controllers})
	require.Eventually(t, func() bool { return len(a.Shards(coord.Controllers)) == coord.NumShards }, 10*time.Second, 10*time.Millisecond)
	var epochsBefore int64
	require.NoError(t, db.Pool.QueryRow(context.Background(), "SELECT sum(epoch) FROM leases").Scan(&epochsBefore))

	b := startRenewer(t, db, "wb", true, []coord.Group{coord.Controllers})
	want := coord.Assign([]string{"wa", "wb"})
	nb := 0
	for _, o := range want {
		if o == "wb" {
			nb++
		}
	}
	require.Eventually(t, func() bool { return len(b.Shards(coord.Controllers)) == nb && holdsAll(a, b)() }, 15*time.Second, 10*time.Millisecond)
	var epochsAfter int64
	require.NoError(t, db.Pool.QueryRow(context.Background(), "SELECT sum(epoch) FROM leases").Scan(&epochsAfter))
	require.Equal(t, epochsBefore+int64(nb), epochsAfter, "only the newcomer's shards changed owner, once each")
}
