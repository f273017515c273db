package coord

import (
	"fmt"
	"sort"
)

// NumShards is the fixed number of shards sharded keys map to.
const NumShards = 256

// fnv1a32 is FNV-1a over the bytes of s. Written out rather than through
// hash/fnv so the hot rendezvous loop allocates nothing.
func fnv1a32(s string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h ^= uint32(s[i])
		h *= 16777619
	}
	return h
}

// fmix32 is murmur3's 32-bit finalizer: it spreads FNV's weak low bits.
func fmix32(h uint32) uint32 {
	h ^= h >> 16
	h *= 0x85ebca6b
	h ^= h >> 13
	h *= 0xc2b2ae35
	h ^= h >> 16
	return h
}

// ShardOf maps a sharded key (a node id, a pool id, a site id) to its shard:
// FNV-1a 32 of the key modulo 256.
func ShardOf(key string) int { return int(fnv1a32(key) % NumShards) }

// Hash32 is FNV-1a 32 followed by murmur3's fmix32: the rendezvous weight.
func Hash32(s string) uint32 { return fmix32(fnv1a32(s)) }

// RendezvousOwner returns the member with the highest Hash32("<member>#<shard>"),
// ties to the lower id; "" when members is empty. Every process computes the
// same owner from the same member set, with no coordination.
func RendezvousOwner(members []string, shard int) string {
	best, bestW := "", uint32(0)
	suffix := fmt.Sprintf("#%d", shard)
	for _, m := range members {
		w := Hash32(m + suffix)
		if best == "" || w > bestW || (w == bestW && m < best) {
			best, bestW = m, w
		}
	}
	return best
}

// Assign returns, for every shard 0..255, its rendezvous owner among members.
func Assign(members []string) [NumShards]string {
	sorted := append([]string(nil), members...)
	sort.Strings(sorted)
	var out [NumShards]string
	for s := range NumShards {
		out[s] = RendezvousOwner(sorted, s)
	}
	return out
}

// ShardLeaseName is the lease of shard n in a group whose lease prefix is
// prefix ("" for controllers: "shard:<n>"; "scheduler/" for the scheduler).
func ShardLeaseName(prefix string, n int) string { return fmt.Sprintf("%sshard:%d", prefix, n) }
