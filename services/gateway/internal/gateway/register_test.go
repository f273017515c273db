package gateway

import (
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sync/semaphore"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestOlderHelloNeverReplacesNewerSession: two Hellos of one node can
// finish out of order (the first slow, its daemon already redialled and
// welcomed). The session of the older epoch is refused and closed instead
// of replacing the newer one, which stays registered and open; a newer
// epoch still supersedes.
func TestOlderHelloNeverReplacesNewerSession(t *testing.T) {
	t.Parallel()
	g := startGateway(t, pgtest.NewDB(t), testConfig())
	sess := func(epoch int64) *session {
		s := &session{nodeID: "n-order", epoch: epoch, window: 4,
			reports: semaphore.NewWeighted(1 << 20), reportBudget: 1 << 20, output: semaphore.NewWeighted(sessionOutputBudget),
			send: func(*nodev1.ConnectResponse) error { return nil }, breakRecv: func() {}}
		s.generation = g.generation.Load()
		return s
	}
	welcome := func(s *session) *nodev1.Welcome { return &nodev1.Welcome{SessionEpoch: s.epoch, GatewayId: g.id} }
	registered := func() *session {
		g.mu.Lock()
		defer g.mu.Unlock()
		return g.sessions["n-order"]
	}

	seven := sess(7)
	require.True(t, g.registerSession(seven, welcome(seven), nil))
	six := sess(6)
	require.False(t, g.registerSession(six, welcome(six), nil), "an older epoch is refused")
	require.True(t, six.isClosed())
	require.ErrorContains(t, six.finish(), "already has a newer session (epoch 7) than this Hello's (epoch 6)")
	require.Same(t, seven, registered())
	require.False(t, seven.isClosed(), "the newer session is left alone")

	eight := sess(8)
	require.True(t, g.registerSession(eight, welcome(eight), nil))
	require.Same(t, eight, registered())
	require.True(t, seven.isClosed(), "a newer epoch supersedes")
	for _, s := range []*session{seven, eight} {
		s.close(nil)
		_ = s.finish()
	}
	g.mu.Lock()
	delete(g.sessions, "n-order")
	g.mu.Unlock()
}
