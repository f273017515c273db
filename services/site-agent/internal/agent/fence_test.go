package agent

import (
	"flag"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/health"
)

func grant(active bool, epoch uint64, grantedAt time.Time, ttl, promote time.Duration) *nodev1.NodeSpec {
	return &nodev1.NodeSpec{SiteBoot: &nodev1.SiteBoot{Active: active, Epoch: epoch, SiteId: "s1",
		GrantedAt: timestamppb.New(grantedAt), LeaseTtl: durationpb.New(ttl), PromoteAfter: durationpb.New(promote)}}
}

func TestFenceStopsAnsweringSelfFenceAfterTheGrant(t *testing.T) {
	t.Parallel()
	clock := clockwork.NewFakeClock()
	connected := true
	f := NewFence(10*time.Second, "s1", clock, nil, func() bool { return connected })
	_, ok := f.Answering()
	require.False(t, ok)
	require.Equal(t, health.RoleStandby, f.Role())

	f.Apply(grant(true, 3, clock.Now(), 15*time.Second, 15*time.Second))
	epoch, ok := f.Answering()
	require.True(t, ok)
	require.EqualValues(t, 3, epoch)
	clock.Advance(9 * time.Second)
	_, ok = f.Answering()
	require.True(t, ok)
	f.Apply(grant(true, 3, clock.Now(), 15*time.Second, 15*time.Second)) // renewal at 9 s
	clock.Advance(9*time.Second + 999*time.Millisecond)
	_, ok = f.Answering()
	require.True(t, ok, "each grant restarts the window")
	clock.Advance(time.Millisecond)
	_, ok = f.Answering()
	require.False(t, ok, "self-fenced exactly self-fence after the last grant, well before the 15 s TTL")
	require.Equal(t, health.RoleFenced, f.Role())

	// A closed session fences at once.
	f.Apply(grant(true, 3, clock.Now(), 15*time.Second, 15*time.Second))
	connected = false
	_, ok = f.Answering()
	require.False(t, ok)
	connected = true

	// Withdrawn: standby at once.
	f.Apply(grant(false, 4, clock.Now(), 15*time.Second, 15*time.Second))
	_, ok = f.Answering()
	require.False(t, ok)
	require.Equal(t, health.RoleStandby, f.Role())
}

func TestFenceRefusesLateOldAndBadGrants(t *testing.T) {
	t.Parallel()
	clock := clockwork.NewFakeClock()
	f := NewFence(10*time.Second, "s1", clock, nil, nil)
	// Delivered late: granted 8 s ago, only 2 s of trust left.
	f.Apply(grant(true, 5, clock.Now().Add(-8*time.Second), 15*time.Second, 15*time.Second))
	_, ok := f.Answering()
	require.True(t, ok)
	clock.Advance(2 * time.Second)
	_, ok = f.Answering()
	require.False(t, ok, "a late grant buys only what is left of its window")

	// Already older than the self-fence: refused.
	f.Apply(grant(true, 5, clock.Now().Add(-11*time.Second), 15*time.Second, 15*time.Second))
	_, ok = f.Answering()
	require.False(t, ok)

	// An epoch older than one already seen: ignored.
	f.Apply(grant(false, 6, clock.Now(), 15*time.Second, 15*time.Second))
	f.Apply(grant(true, 5, clock.Now(), 15*time.Second, 15*time.Second))
	_, ok = f.Answering()
	require.False(t, ok)

	// Control-plane timings that break self-fence < TTL <= promotion.
	f.Apply(grant(true, 7, clock.Now(), 10*time.Second, 15*time.Second))
	_, ok = f.Answering()
	require.False(t, ok)
	require.Contains(t, f.Detail()["refused"], "--boot.self-fence 10s must be less than the boot lease TTL 10s")
	f.Apply(grant(true, 7, clock.Now(), 15*time.Second, 12*time.Second))
	_, ok = f.Answering()
	require.False(t, ok)

	// Another site's grant, or none, is no grant.
	s := grant(true, 8, clock.Now(), 15*time.Second, 15*time.Second)
	s.SiteBoot.SiteId = "s2"
	f.Apply(s)
	_, ok = f.Answering()
	require.False(t, ok)
	f.Apply(&nodev1.NodeSpec{})
	_, ok = f.Answering()
	require.False(t, ok)

	f.Apply(grant(true, 8, clock.Now(), 15*time.Second, 15*time.Second))
	epoch, ok := f.Answering()
	require.True(t, ok)
	require.EqualValues(t, 8, epoch)
}

func TestStartUpRefusesBrokenOrdering(t *testing.T) {
	t.Parallel()
	parse := func(args ...string) error {
		var c Config
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		c.RegisterFlags("", fs)
		require.NoError(t, fs.Parse(append([]string{"--node-id", "a1", "--node-credential", "x", "--site-id", "s1",
			"--dhcp.server-ip", "10.0.0.2", "--cache.dir", t.TempDir()}, args...)))
		return c.Resolve()
	}
	require.NoError(t, parse())
	require.ErrorContains(t, parse("--boot.self-fence", "15s"),
		"--boot.self-fence 15s must be positive and less than --boot.lease-ttl 15s (self-fence < TTL)")
	require.ErrorContains(t, parse("--boot.promote-after", "12s"),
		"--boot.lease-ttl 15s must be <= --boot.promote-after 12s (TTL <= promotion)")
	require.ErrorContains(t, parse("--dhcp.listen-addr", "nonsense"), "--dhcp.listen-addr")
}
