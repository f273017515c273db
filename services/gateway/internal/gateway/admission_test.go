package gateway

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/daemon"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func noopHandler(context.Context, *nodev1.Command) daemon.Outcome { return daemon.Outcome{} }

// TestAdmissionPacesThousandSimultaneousDials: 1,000 daemons dial one
// gateway at once. The handshake bucket admits them at its rate, the rest
// get a retry-after pushback and come back; every dial ends welcomed, none is
// lost, and (pgtest.Main) no goroutine leaks.
func TestAdmissionPacesThousandSimultaneousDials(t *testing.T) {
	if testing.Short() {
		t.Skip("slow: 1,000 real streams")
	}
	db := pgtest.NewDB(t)
	cfg := testConfig()
	cfg.HeartbeatInterval, cfg.SessionLease, cfg.LivenessInterval = 5*time.Second, 30*time.Second, time.Second
	const n = 1000
	g := startGateway(t, db, cfg)
	creds := registerNodes(t, db, "h", n)

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	daemons := make([]*daemon.Daemon, n)
	start := time.Now()
	for i := range n {
		d, err := daemon.New(daemon.Config{
			Address: "http://" + g.Addr(), NodeID: creds2id("h", i), Credential: creds[i], Handler: noopHandler,
			BackoffBase: 100 * time.Millisecond, BackoffMax: 2 * time.Second,
		})
		require.NoError(t, err)
		daemons[i] = d
		wg.Add(1)
		go func() { defer wg.Done(); _ = d.Run(ctx) }()
	}
	defer func() { cancel(); wg.Wait() }()

	require.Eventually(t, func() bool { return g.SessionCount() == n }, 90*time.Second, 20*time.Millisecond)
	elapsed := time.Since(start)
	var st daemon.Stats
	for _, d := range daemons {
		s := d.Stats()
		st.Dials += s.Dials
		st.Welcomes += s.Welcomes
		st.Pushbacks += s.Pushbacks
	}
	minimum := time.Duration(float64(n-cfg.HelloBurst) / cfg.HelloRate * float64(time.Second))
	t.Logf("%d sessions in %s (bucket minimum %s): %d dials, %d pushbacks, %.0f Hellos/s",
		n, elapsed.Round(time.Millisecond), minimum, st.Dials, st.Pushbacks, float64(n)/elapsed.Seconds())
	require.EqualValues(t, n, st.Welcomes, "every daemon welcomed exactly once: no dial lost, no session dropped")
	require.Positive(t, st.Pushbacks)
	require.GreaterOrEqual(t, elapsed, minimum*8/10, "Hellos must be paced by the bucket")
	require.InDelta(t, n, testutil.ToFloat64(g.m.hellos.WithLabelValues("welcomed")), 0)
	var rows int
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		`SELECT count(*) FROM node_sessions WHERE gateway_id = $1 AND state = 'connected'`, g.ID()).Scan(&rows))
	require.Equal(t, n, rows)
}

func creds2id(prefix string, i int) string { return fmt.Sprintf("%s-%d", prefix, i) }
