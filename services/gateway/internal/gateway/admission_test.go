package gateway

import (
	"context"
	"fmt"
	"sort"
	"strings"
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

// herd is n daemons released at once against one gateway.
type herd struct {
	g       *Gateway
	daemons []*daemon.Daemon
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	start   time.Time
}

// dialHerd creates n registered daemons and releases their dials
// together; stop ends them.
func dialHerd(t testing.TB, db *pgtest.DB, g *Gateway, n int) *herd {
	t.Helper()
	creds := registerNodes(t, db, "h", n)
	h := &herd{g: g, daemons: make([]*daemon.Daemon, n)}
	for i := range n {
		d, err := daemon.New(daemon.Config{
			Address: "http://" + g.Addr(), NodeID: creds2id("h", i), Credential: creds[i], Handler: noopHandler,
			BackoffBase: 100 * time.Millisecond, BackoffMax: 2 * time.Second,
			// The herd is about admission, not about how long a Hello may
			// take: on a loaded machine (the race detector, other tests) a
			// Hello can outlast the default 15 s, and a daemon that gives
			// up redials and is welcomed twice.
			HelloTimeout: 2 * time.Minute,
		})
		require.NoError(t, err)
		h.daemons[i] = d
	}
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	release := make(chan struct{})
	for _, d := range h.daemons {
		h.wg.Add(1)
		go func() {
			defer h.wg.Done()
			<-release
			_ = d.Run(ctx)
		}()
	}
	h.start = time.Now()
	close(release)
	return h
}

func (h *herd) stop() { h.cancel(); h.wg.Wait() }

func (h *herd) stats() daemon.Stats {
	var st daemon.Stats
	for _, d := range h.daemons {
		s := d.Stats()
		st.Dials += s.Dials
		st.Welcomes += s.Welcomes
		st.Pushbacks += s.Pushbacks
	}
	return st
}

// report is the state of the herd for a failure message or a log line.
func (h *herd) report() string {
	st := h.stats()
	var reasons []string
	for _, r := range []string{"hello-rate", "max-pending-hellos", "max-streams", "draining"} {
		reasons = append(reasons, fmt.Sprintf("%s=%.0f", r, testutil.ToFloat64(h.g.m.pushbacks.WithLabelValues(r))))
	}
	var outcomes []string
	for _, o := range []string{"welcomed", "pushback", "unauthenticated", "refused", "error"} {
		outcomes = append(outcomes, fmt.Sprintf("%s=%.0f", o, testutil.ToFloat64(h.g.m.hellos.WithLabelValues(o))))
	}
	sort.Strings(outcomes)
	return fmt.Sprintf("%d of %d sessions connected after %s; gateway serving=%v; daemons: %d dials, %d welcomes, %d pushbacks; gateway pushbacks {%s}, hellos {%s}",
		h.g.SessionCount(), len(h.daemons), time.Since(h.start).Round(time.Millisecond), h.g.state.Load() == stateServing,
		st.Dials, st.Welcomes, st.Pushbacks, strings.Join(reasons, " "), strings.Join(outcomes, " "))
}

// awaitAll waits until every daemon has a session, for as long as sessions
// keep connecting: it fails only when no new session connected for
// stallAfter (a lost dial, not a slow machine), and then says how far the
// herd got.
func (h *herd) awaitAll(t testing.TB, stallAfter time.Duration) {
	t.Helper()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	last, lastChange := -1, time.Now()
	for range tick.C {
		n := h.g.SessionCount()
		// The gateway registers a session before its Welcome reaches the
		// daemon: done when both sides have counted every one.
		if n == len(h.daemons) && h.stats().Welcomes >= int64(len(h.daemons)) {
			return
		}
		if n != last {
			last, lastChange = n, time.Now()
		}
		if time.Since(lastChange) > stallAfter {
			t.Fatalf("admission stalled: no new session for %s: %s", stallAfter, h.report())
		}
	}
}

// TestAdmissionPacesThousandSimultaneousDials: 1,000 daemons dial one
// gateway at once. The handshake bucket admits them at its rate, the rest
// get a retry-after pushback and come back; every dial ends welcomed, none is
// lost, and (pgtest.Main) no goroutine leaks.
//
// It checks behaviour, not speed, so a loaded machine cannot fail it: it
// waits as long as sessions keep connecting, sees the pacing in the
// limiter's own counter (hello-rate pushbacks), and bounds admissions from
// above by what the bucket can have granted (a slow machine only makes
// that bound looser). The rate itself is measured by BenchmarkHello and
// BenchmarkAdmissionHerd.
func TestAdmissionPacesThousandSimultaneousDials(t *testing.T) {
	if testing.Short() {
		t.Skip("slow: 1,000 real streams")
	}
	db := pgtest.NewDB(t)
	cfg := herdConfig()
	// A bucket slow enough that 1,000 simultaneous dials outrun it on any
	// machine: admitting them all takes at least (1000-20)/100 = 9.8 s.
	cfg.HelloRate, cfg.HelloBurst = 100, 20
	const n = 1000
	g := startGateway(t, db, cfg)
	h := dialHerd(t, db, g, n)
	defer h.stop()

	h.awaitAll(t, time.Minute)
	elapsed := time.Since(h.start)
	st := h.stats()
	t.Logf("%s", h.report())
	require.EqualValues(t, n, st.Welcomes, "every daemon welcomed exactly once: no dial lost, no session dropped: %s", h.report())
	require.InDelta(t, n, testutil.ToFloat64(g.m.hellos.WithLabelValues("welcomed")), 0)
	rateRefused := testutil.ToFloat64(g.m.pushbacks.WithLabelValues("hello-rate"))
	require.Positive(t, rateRefused, "the bucket refused part of the herd: %s", h.report())
	require.Positive(t, st.Pushbacks, "the daemons saw the pushbacks and came back")
	ceiling := float64(cfg.HelloBurst) + cfg.HelloRate*elapsed.Seconds()
	require.LessOrEqual(t, float64(n), ceiling, "no more Hellos admitted than the bucket can grant")
	var rows int
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		`SELECT count(*) FROM node_sessions WHERE gateway_id = $1 AND state = 'connected'`, g.ID()).Scan(&rows))
	require.Equal(t, n, rows)
}

// BenchmarkAdmissionHerd measures how fast a herd of 1,000 simultaneous
// dials is admitted through the default bucket (sessions per second until
// the last one connects); it reports the pushbacks it took.
func BenchmarkAdmissionHerd(b *testing.B) {
	cfg := herdConfig()
	const n = 1000
	for range b.N {
		db := pgtest.NewDB(b)
		g := startGateway(b, db, cfg)
		h := dialHerd(b, db, g, n)
		h.awaitAll(b, time.Minute)
		elapsed := time.Since(h.start)
		b.ReportMetric(float64(n)/elapsed.Seconds(), "sessions/s")
		b.ReportMetric(testutil.ToFloat64(g.m.pushbacks.WithLabelValues("hello-rate")), "rate-pushbacks")
		h.stop()
	}
}

// herdConfig is testConfig with generous lease timings: a herd of 1,000
// dials on a loaded machine (and a database shared with other suites) must
// not delay the gateway's own lease renewal past its fence, half the TTL
// (the gateway would fence itself and close its listener, which is not
// what these are about).
func herdConfig() Config {
	cfg := testConfig()
	cfg.LeaseTTL, cfg.LeaseRenew = time.Minute, 2*time.Second
	cfg.SessionLease, cfg.HeartbeatInterval, cfg.LivenessInterval = 2*time.Minute, 10*time.Second, 5*time.Second
	cfg.HelloTimeout = time.Minute // a starved daemon's Hello is late, not missing
	return cfg
}

func creds2id(prefix string, i int) string { return fmt.Sprintf("%s-%d", prefix, i) }
