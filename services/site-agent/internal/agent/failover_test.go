package agent

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/insomniacslk/dhcp/dhcpv4/nclient4"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/leasehold/leasehold/pkg/faultproxy"
	"github.com/leasehold/leasehold/pkg/fleettest"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/nodereg"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/services/site-agent/internal/pxe"
	"github.com/leasehold/leasehold/services/site-agent/internal/tftp"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// Short boot timings for ordering tests: self-fence 2 s < TTL 3 s <=
// promotion 3 s, grants renewed every 500 ms.
const (
	testSelfFence = 2 * time.Second
	testTTL       = 3 * time.Second
)

// siteGatewayArgs are FastGateway with a longer gateway lease (8 s, renewed
// every 2 s): these tests are about the boot lease, and a 2 s gateway lease
// can run out on a machine saturated by other tests (a VM under TCG beside
// them), which fences the gateway and fails the test for an unrelated reason.
var siteGatewayArgs = append(append([]string{}, fleettest.FastGateway...), "--gateway.spec-poll", "200ms",
	"--gateway.lease-ttl", "8s", "--gateway.lease-renew", "2s", "--gateway.session-lease", "12s")

var siteWorkerArgs = []string{"--sites.boot-lease-ttl", "3s", "--sites.promote-after", "3s",
	"--sites.renew-interval", "500ms", "--sites.scan-interval", "500ms"}

type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type testAgent struct {
	*Agent
	id    string
	proxy *faultproxy.Proxy
	probe *nclient4.Client
}

func startAgent(t *testing.T, id, site, cred, gatewayAddr string, logs *syncBuf, mutate ...func(*Config)) *testAgent {
	t.Helper()
	proxy, err := faultproxy.New(gatewayAddr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	cfg := Config{
		GatewayURL: proxy.URL(), NodeID: id, Credential: cred, SiteID: site, BackoffMax: 300 * time.Millisecond,
		SelfFence: testSelfFence, LeaseTTL: testTTL, PromoteAfter: testTTL,
		DHCP: pxeConfig(), BootListenAddr: "127.0.0.1:0", BootBaseURL: "http://127.0.0.1:8080",
	}
	cfg.Cache.Dir, cfg.Cache.MaxBytes, cfg.Cache.Budget, cfg.Cache.Attempts = t.TempDir(), 1<<20, 4<<20, 3
	cfg.Journal = filepath.Join(t.TempDir(), "journal")
	cfg.TFTP = tftpConfig(t)
	for _, m := range mutate {
		m(&cfg)
	}
	cfg.DHCP.ScriptBaseURL = cfg.BootBaseURL
	log := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})).With("agent", id)
	a, err := New(cfg, Deps{Logger: log})
	require.NoError(t, err)
	require.NoError(t, services.StartAndAwaitRunning(context.Background(), a))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		_ = services.StopAndAwaitTerminated(ctx, a)
	})
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	probe, err := nclient4.NewWithConn(conn, probeMAC, nclient4.WithServerAddr(a.DHCPAddr()),
		nclient4.WithTimeout(60*time.Millisecond), nclient4.WithRetry(1))
	require.NoError(t, err)
	t.Cleanup(func() { _ = probe.Close() })
	return &testAgent{Agent: a, id: id, proxy: proxy, probe: probe}
}

var probeMAC = net.HardwareAddr{0x52, 0x54, 0x00, 0xaa, 0xbb, 0xcc}

// offers sends one PXE DHCPDISCOVER to the agent and reports whether it
// answered with an offer.
func (a *testAgent) offers() bool {
	_, err := a.probe.DiscoverOffer(context.Background(), dhcpv4.WithOption(dhcpv4.OptClassIdentifier("PXEClient:Arch:00000:UNDI:002001")))
	return err == nil
}

type sample struct {
	at           time.Time
	fence        [2]bool // Answering() of each agent
	epochs       [2]uint64
	dhcp         [2]bool // a real DHCP offer
	dhcpSampled  bool
	fenceSampled bool
}

// sampler records both agents' answering state every 20 ms and real DHCP
// answers from both every ~100 ms, failing at once if both answer.
type sampler struct {
	mu      sync.Mutex
	samples []sample
	both    []string
}

func (s *sampler) run(ctx context.Context, agents [2]*testAgent) {
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			var sm sample
			sm.at, sm.fenceSampled = time.Now(), true
			for i, a := range agents {
				sm.epochs[i], sm.fence[i] = a.Answering()
			}
			s.add(sm)
			time.Sleep(20 * time.Millisecond) // sampling interval of an invariant checked until ctx ends
		}
	}()
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			var sm sample
			sm.at, sm.dhcpSampled = time.Now(), true
			var pw sync.WaitGroup
			for i, a := range agents {
				pw.Add(1)
				go func() { defer pw.Done(); sm.dhcp[i] = a.offers() }()
			}
			pw.Wait()
			s.add(sm)
			time.Sleep(100 * time.Millisecond) // sampling interval (DHCP probes) until ctx ends
		}
	}()
	wg.Wait()
}

func (s *sampler) add(sm sample) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if (sm.fenceSampled && sm.fence[0] && sm.fence[1]) || (sm.dhcpSampled && sm.dhcp[0] && sm.dhcp[1]) {
		s.both = append(s.both, fmt.Sprintf("%s: %+v", sm.at.Format(time.StampMilli), sm))
	}
	s.samples = append(s.samples, sm)
}

func (s *sampler) since(t time.Time) []sample {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []sample
	for _, sm := range s.samples {
		if !sm.at.Before(t) {
			out = append(out, sm)
		}
	}
	return out
}

// TestTwoAgentsOneAnswersAndFailoverNeverOverlaps runs a real gateway and a
// real worker process and two in-process agents of one site. Exactly one
// agent answers PXE DHCPDISCOVERs. The active agent's connection is cut
// (and redials refused): nobody answers until its lease has expired, then
// the standby answers with epoch + 1; both agents' state and real DHCP
// replies are sampled throughout and never both answer. A discovery report
// at the old epoch is refused, from either agent.
func TestTwoAgentsOneAnswersAndFailoverNeverOverlaps(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	db := pgtest.NewDB(t)
	ctx := context.Background()
	gw := fleettest.StartGateway(t, db.URL, "gw_site", siteGatewayArgs...)
	fleettest.StartService(t, "worker", db.URL, "w_site", append(append([]string{}, fleettest.FastCoord...), siteWorkerArgs...)...)

	var logs syncBuf
	defer func() {
		if t.Failed() {
			t.Logf("--- agent logs ---\n%s", logs.String())
		}
	}()
	var agents [2]*testAgent
	for i, id := range []string{"agent-a", "agent-b"} {
		cred, err := nodereg.Register(ctx, db.Pool, nodereg.Node{ID: id, Kind: "site_agent", SiteID: "site1"})
		require.NoError(t, err)
		agents[i] = startAgent(t, id, "site1", cred, gw.Listen, &logs)
	}

	start := time.Now()
	require.Eventually(t, func() bool {
		_, a := agents[0].Answering()
		_, b := agents[1].Answering()
		return a != b
	}, 20*time.Second, 20*time.Millisecond, "one agent becomes active")
	t.Logf("first grant after %s", time.Since(start).Round(time.Millisecond))

	sctx, stopSampling := context.WithCancel(ctx)
	s := &sampler{}
	sampled := make(chan struct{})
	go func() { defer close(sampled); s.run(sctx, agents) }()
	defer func() { stopSampling(); <-sampled }()

	// Several renewals (the lease's expiry moved at least twice) and more
	// than five DHCP samples: the holder keeps answering meanwhile.
	var (
		lastExpiry time.Time
		renewals   int
	)
	require.Eventually(t, func() bool {
		var exp time.Time
		if err := db.Pool.QueryRow(ctx, "SELECT expires_at FROM leases WHERE name = 'site:site1:boot'").Scan(&exp); err != nil {
			return false
		}
		if !lastExpiry.IsZero() && exp.After(lastExpiry) {
			renewals++
		}
		lastExpiry = exp
		dhcp := 0
		for _, sm := range s.since(start) {
			if sm.dhcpSampled {
				dhcp++
			}
		}
		return renewals >= 2 && dhcp > 5
	}, 60*time.Second, 50*time.Millisecond, "two renewals and six DHCP samples")
	act, stb := 0, 1
	if _, ok := agents[1].Answering(); ok {
		act, stb = 1, 0
	}
	epoch, ok := agents[act].Answering()
	require.True(t, ok)
	require.EqualValues(t, 1, epoch)
	var steady, steadyOffers int
	for _, sm := range s.since(start) {
		if sm.dhcpSampled {
			steady++
			if sm.dhcp[act] && !sm.dhcp[stb] {
				steadyOffers++
			}
		}
	}
	require.Greater(t, steady, 5)
	require.Equal(t, steady, steadyOffers, "exactly one agent, the holder, answers every DISCOVER while it holds the lease")

	// Cut the active agent off: its stream closes and redials are refused.
	agents[act].proxy.Refuse()
	agents[act].proxy.CutAll()
	killedAt := time.Now()
	time.Sleep(500 * time.Millisecond) // a window for a wrongful release: what is checked is that the disconnected holder keeps the lease
	var (
		expiresAt time.Time
		owner     string
		dbNow     time.Time
	)
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT owner, expires_at, compute_now() FROM leases WHERE name = 'site:site1:boot'").Scan(&owner, &expiresAt, &dbNow))
	require.Equal(t, agents[act].id, owner, "a disconnected holder keeps the lease")
	localExpiry := time.Now().Add(expiresAt.Sub(dbNow)) // the same host: the DB clock is this clock

	require.Eventually(t, func() bool {
		e, ok := agents[stb].Answering()
		return ok && e == 2
	}, 20*time.Second, 10*time.Millisecond, "the standby answers at epoch 2")
	promotedAt := time.Now()
	require.Eventually(t, func() bool { return agents[stb].offers() }, 5*time.Second, 10*time.Millisecond)
	offeredAfter := time.Since(promotedAt)
	time.Sleep(time.Second) // a window of sampling after the promotion: what is checked is that both never answer
	stopSampling()
	<-sampled

	s.mu.Lock()
	require.Empty(t, s.both, "at no sampled instant did both agents answer")
	s.mu.Unlock()
	var (
		lastOld, firstNew time.Time
		quiet             int
	)
	for _, sm := range s.since(killedAt) {
		if sm.fence[act] || sm.dhcp[act] {
			lastOld = sm.at
		}
		if (sm.fence[stb] || sm.dhcp[stb]) && firstNew.IsZero() {
			firstNew = sm.at
		}
		if sm.dhcpSampled && !sm.dhcp[0] && !sm.dhcp[1] && sm.at.Before(localExpiry) {
			quiet++
		}
	}
	require.False(t, firstNew.IsZero())
	require.True(t, lastOld.IsZero() || lastOld.Before(killedAt.Add(100*time.Millisecond)),
		"the cut-off agent stops at once (its session closed); last answer %s after the cut", lastOld.Sub(killedAt))
	require.False(t, firstNew.Before(localExpiry), "the standby answered %s before the lease expired", localExpiry.Sub(firstNew))
	require.Greater(t, quiet, 3, "no answer from anyone until the lease expired")
	var leaseOwner string
	var leaseEpoch int64
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT owner, epoch FROM leases WHERE name = 'site:site1:boot'").Scan(&leaseOwner, &leaseEpoch))
	require.Equal(t, agents[stb].id, leaseOwner)
	require.EqualValues(t, 2, leaseEpoch)
	t.Logf("cut -> lease expiry %s, cut -> standby answering %s (first sample after expiry: +%s), standby's first DHCP offer %s after its grant",
		localExpiry.Sub(killedAt).Round(time.Millisecond), promotedAt.Sub(killedAt).Round(time.Millisecond),
		firstNew.Sub(localExpiry).Round(time.Millisecond), offeredAfter.Round(time.Millisecond))

	// Discovery: the probes' unknown MAC was reported by each holder at its
	// own epoch. Reports at the old epoch are refused afterwards, from the
	// new holder and from the old one once it is back.
	discoveries := func() map[string]int64 {
		rows, err := db.Pool.Query(ctx, "SELECT id, boot_epoch FROM node_events WHERE kind = 'discovery'")
		require.NoError(t, err)
		defer rows.Close()
		out := map[string]int64{}
		for rows.Next() {
			var id string
			var e int64
			require.NoError(t, rows.Scan(&id, &e))
			out[id] = e
		}
		return out
	}
	require.Eventually(t, func() bool {
		d := discoveries()
		return d["discovery/525400aabbcc/1"] == 1 && d["discovery/525400aabbcc/2"] == 2
	}, 5*time.Second, 50*time.Millisecond, "each holder reported the unknown MAC at its epoch: %v", discoveries())

	stale := func(id string) *nodev1.Event {
		p, _ := structpb.NewStruct(map[string]any{"mac": "52:54:00:de:ad:01"})
		return &nodev1.Event{EventId: id, Kind: DiscoveryEventKind, Payload: p, BootEpoch: 1}
	}
	require.NoError(t, agents[stb].SendDiscovery(stale("stale-from-new-holder")))
	agents[act].proxy.Restore()
	require.Eventually(t, func() bool { return agents[act].d.Welcome() != nil }, 10*time.Second, 20*time.Millisecond)
	_, ok = agents[act].Answering()
	require.False(t, ok, "the old holder comes back as a standby")
	require.NoError(t, agents[act].SendDiscovery(stale("stale-from-old-holder")))
	// A fresh report at the current epoch still goes through after them.
	fresh := stale("fresh")
	fresh.BootEpoch = 2
	require.NoError(t, agents[stb].SendDiscovery(fresh))
	require.Eventually(t, func() bool { _, ok := discoveries()["fresh"]; return ok }, 5*time.Second, 20*time.Millisecond)
	time.Sleep(300 * time.Millisecond) // the old holder's report travels a separate stream
	d := discoveries()
	require.NotContains(t, d, "stale-from-new-holder")
	require.NotContains(t, d, "stale-from-old-holder")
	for id, e := range d {
		require.Contains(t, []int64{1, 2}, e, id)
	}
}

func tftpConfig(t *testing.T) tftp.Config {
	return tftp.Config{ListenAddr: "127.0.0.1:0", Root: t.TempDir(), MaxTransfers: 4, MaxBlockSize: 1468,
		Timeout: time.Second, Retries: 3}
}

func pxeConfig() (c pxe.Config) {
	c.ListenAddr = "127.0.0.1:0"
	c.ServerIP = net.IPv4(127, 0, 0, 1).To4()
	c.BootFileBIOS, c.BootFileEFI = "undionly.kpxe", "ipxe.efi"
	return c
}
