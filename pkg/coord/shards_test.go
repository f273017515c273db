package coord_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
)

func TestShardOfAndHash32AreFixed(t *testing.T) {
	t.Parallel()
	// FNV-1a 32 of "" is the offset basis; of "a" is 0xe40c292c.
	require.Equal(t, int(uint32(2166136261)%256), coord.ShardOf(""))
	require.Equal(t, int(uint32(0xe40c292c)%256), coord.ShardOf("a"))
	for _, k := range []string{"node-1", "pool/x", "site:eu-1", "ünïcode"} {
		s := coord.ShardOf(k)
		require.GreaterOrEqual(t, s, 0)
		require.Less(t, s, 256)
		require.Equal(t, s, coord.ShardOf(k), "stable")
	}
	require.NotEqual(t, coord.Hash32("w1#0"), coord.Hash32("w1#1"))
}

func randomMembers(r *rand.Rand, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("worker-%08x", r.Uint32())
	}
	return out
}

func TestRendezvousEveryMemberAgrees(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(1, 2))
	for n := 1; n <= 16; n++ {
		members := randomMembers(r, n)
		want := coord.Assign(members)
		for range 5 {
			shuffled := append([]string(nil), members...)
			r.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
			require.Equal(t, want, coord.Assign(shuffled))
		}
	}
	require.Equal(t, "", coord.RendezvousOwner(nil, 3))
}

func TestRendezvousTiesGoToLowerID(t *testing.T) {
	t.Parallel()
	// The same id twice has the same weight: the tie goes to the lower id,
	// whatever the order.
	require.Equal(t, "a", coord.RendezvousOwner([]string{"a", "a"}, 1))
}

// TestRendezvousAddingAMemberMovesOnlyOntoIt: a newcomer takes shards only
// from others, never moving one between old members. How many it takes is
// Binomial(256, 1/(N+1)): the bound ceil(256/(N+1)) * 1.25 holds for
// the mean over member sets; a single set may exceed it by chance, so each
// trial is held to the mean plus five standard deviations.
func TestRendezvousAddingAMemberMovesOnlyOntoIt(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(3, 4))
	const trials = 40
	for n := 1; n <= 16; n++ {
		total := 0
		p := 1 / float64(n+1)
		mean, sd := 256*p, math.Sqrt(256*p*(1-p))
		for trial := range trials {
			members := randomMembers(r, n)
			before := coord.Assign(members)
			newcomer := fmt.Sprintf("new-%d-%d", n, trial)
			after := coord.Assign(append(members, newcomer))
			moved := 0
			for s := range coord.NumShards {
				if before[s] != after[s] {
					moved++
					require.Equal(t, newcomer, after[s], "shard %d moved between old members", s)
				}
			}
			require.LessOrEqual(t, float64(moved), mean+5*sd, "n=%d: one join moved %d shards", n, moved)
			total += moved
		}
		limit := math.Ceil(256.0/float64(n+1)) * 1.25
		avg := float64(total) / trials
		require.LessOrEqual(t, avg, limit, "n=%d: a join moved %.1f shards on average, bound %.1f", n, avg, limit)
		require.Greater(t, avg, 0.0)
	}
}

func TestRendezvousRemovingAMemberMovesOnlyItsShards(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(5, 6))
	for trial := range 50 {
		n := 2 + trial%15
		members := randomMembers(r, n)
		before := coord.Assign(members)
		gone := members[r.IntN(n)]
		var rest []string
		for _, m := range members {
			if m != gone {
				rest = append(rest, m)
			}
		}
		after := coord.Assign(rest)
		for s := range coord.NumShards {
			if before[s] != gone {
				require.Equal(t, before[s], after[s], "shard %d of a surviving member moved", s)
			} else {
				require.NotEqual(t, gone, after[s])
			}
		}
	}
}

func TestPlanShardsOrphansAndHandback(t *testing.T) {
	t.Parallel()
	ttl := 15 * time.Second
	members := []coord.Member{{ID: "a"}, {ID: "b"}, {ID: "c"}}
	assign := coord.Assign([]string{"a", "b", "c"})

	// All live: a wants exactly its rendezvous shards and no orphans.
	p := coord.PlanShards("a", members, nil, ttl)
	require.Empty(t, p.Orphans)
	for _, s := range p.Mine {
		require.Equal(t, "a", assign[s])
	}

	// b silent for more than one TTL but still in the live set: its shards
	// are orphans that a (and c) try.
	members[1].Age = 16 * time.Second
	p = coord.PlanShards("a", members, nil, ttl)
	for _, s := range p.Orphans {
		require.Equal(t, "b", assign[s])
	}
	require.NotEmpty(t, p.Orphans)
	held := map[int]bool{}
	for _, s := range p.Want() {
		held[s] = true
	}

	// b heartbeats again: a lets its orphans go.
	members[1].Age = time.Second
	p = coord.PlanShards("a", members, held, ttl)
	require.Empty(t, p.Orphans)
	for _, s := range p.Release {
		require.Equal(t, "b", assign[s])
	}
	require.NotEmpty(t, p.Release)

	// A member is never its own orphan.
	members[0].Age = time.Hour
	p = coord.PlanShards("a", members, nil, ttl)
	require.NotEmpty(t, p.Mine)
}

func TestTimingsOrderingsAreEnforced(t *testing.T) {
	t.Parallel()
	require.NoError(t, coord.DefaultTimings().Validate())
	require.Equal(t, time.Second, coord.DefaultTimings().Tick())
	bad := coord.DefaultTimings()
	bad.Renew = 8 * time.Second
	err := bad.Validate()
	require.ErrorContains(t, err, "renew interval 8s must be positive and below half the lease TTL 15s")
	bad = coord.DefaultTimings()
	bad.LiveWindow = 10 * time.Second
	require.ErrorContains(t, bad.Validate(), "live worker window 10s must be longer than the lease TTL 15s")
	fast := coord.Timings{LeaseTTL: time.Second, Renew: 100 * time.Millisecond, LiveWindow: 2 * time.Second, ForgetAfter: time.Minute}
	require.Equal(t, 50*time.Millisecond, fast.Tick())
}
