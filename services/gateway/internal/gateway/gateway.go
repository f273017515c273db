// Package gateway serves node sessions (docs/design.md#gateways): Connect
// streams authenticated on Hello, the gateway:<id> lease and its self-fence,
// session epochs, batched liveness, dispatch, admission and drain.
//
// States of a gateway process:
//
//	starting ──lease granted──▶ serving ──SIGTERM──▶ draining ──streams gone or deadline──▶ release lease, exit 0
//	                            ▲   │
//	        lease taken again   │   └─ another owner, a failed fence, or no renewal for TTL/2 (a database outage)
//	        (a new epoch)       │                     │
//	                            └──────── fenced ◀────┘  close every stream UNAVAILABLE, refuse Hellos, not ready
//
// The lease is kept by a coord.Keeper for the life of the process. A fenced
// gateway stays up: it writes nothing, answers not ready, and the keeper
// keeps trying to take gateway:<id> again; once it does, at a new epoch (so
// nothing in flight from before the fence can pass a fence), the gateway
// serves again. No database outage needs a restart.
package gateway

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/grpchealth"
	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jonboulle/clockwork"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/semaphore"
	"golang.org/x/time/rate"

	"github.com/leasehold/leasehold/pkg/buildinfo"
	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1/nodev1connect"
	"github.com/leasehold/leasehold/pkg/health"
	"github.com/leasehold/leasehold/pkg/reload"
	"github.com/leasehold/leasehold/pkg/tracing"
)

// Deps are what a gateway needs from its process.
type Deps struct {
	// ID is the process id: the lease is gateway:<ID>.
	ID string
	// DB is the pool every transaction uses.
	DB *pgxpool.Pool
	// NotifyURL is a direct URL for LISTEN; "" means poll only.
	NotifyURL string
	// Logger, Registry: the process's. Health may be nil.
	Logger   *slog.Logger
	Registry prometheus.Registerer
	Health   *health.Handler
	// Clock is the process clock (nil: real).
	Clock clockwork.Clock
	// Tracer records the dispatch and result spans of traced commands
	// (nil: the global provider, a no-op unless the process turned
	// tracing on).
	Tracer trace.TracerProvider
}

const (
	stateStarting int32 = iota
	stateServing
	stateDraining
	stateFenced
)

// Gateway is the gateway component: a dskit service.
type Gateway struct {
	services.Service

	cfg       Config
	id        string
	db        *pgxpool.Pool
	notifyURL string
	log       *slog.Logger
	clock     clockwork.Clock
	m         *metrics
	keeper    *coord.Keeper
	limiter   *rate.Limiter
	checker   *grpchealth.StaticChecker
	// minDaemonVersion is --gateway.min-daemon-version as a canonical
	// release ("v1.2.3"), or "" to accept every version.
	minDaemonVersion string

	ln  net.Listener
	srv nodeServer

	state   atomic.Int32
	streams atomic.Int64
	pending atomic.Int64
	// helloSlots is how many Hello transactions may run at once: the
	// smaller of MaxPendingHellos and half the pool (helloSlotsFor);
	// helloRun holds them.
	helloSlots int64
	helloRun   *semaphore.Weighted
	// auths bounds the credential checks in flight (MaxPendingAuths).
	auths *semaphore.Weighted

	mu       sync.Mutex
	sessions map[string]*session

	dispatchWaker *nodeWaker
	// ingest is the group commit of results, acks and events (ingest.go).
	ingest    *ingester
	specWaker *nodeWaker

	// fenceMu orders fence and unfence; fencedCh is closed at each fence
	// (drain watches it) and replaced when serving resumes; generation
	// counts fences, so a Hello that straddled one is not registered.
	fenceMu     sync.Mutex
	fencedCh    chan struct{}
	fenceReason string
	// servedEpoch is the lease epoch the gateway last served at (under
	// fenceMu): a take at that epoch or older, such as the first take's
	// OnAcquired arriving late, never undoes a fence.
	servedEpoch int64
	generation  atomic.Uint64
	// waits are the dispatch waits of the current load tick (load.go).
	waits dispatchWaits
	// resultsRead counts the results read from nodes since the last load
	// tick took it: the rate the queue behind full windows drains at.
	resultsRead atomic.Int64
	ownSkew     atomic.Int64 // this process's clock minus the database's, ns (skew.go)
	stopping    atomic.Bool  // SIGTERM: a lease taken again no longer resumes serving
	keeperStop  context.CancelFunc
	keeperDone  chan struct{}
	keeperDB    *pgxpool.Pool // the keeper's own pool (lease.go)

	slotMu   sync.Mutex
	nextSlot time.Time

	tls    *reload.TLS // nil: h2c
	tracer trace.Tracer

	// tunnels are the open tunnels (tunnel.go); relayLn and relaySrv the
	// relay listener (relay.go), nil without --gateway.relay-listen-addr.
	tunnels   tunnelTable
	relayAuth *relayAuth // nil without a relay
	relayLn   net.Listener
	relaySrv  *http.Server

	// queuedOutput is the live output bytes queued for the group commit
	// and not yet answered, over all sessions; queuedOutputPeak its
	// highest value (output.go).
	queuedOutput, queuedOutputPeak atomic.Int64
	// watchers are the WatchOutput calls relaying live output (watch.go).
	watchers outputWatchers
}

// New builds a gateway; it listens and takes its lease when started.
func New(cfg Config, deps Deps) (_ *Gateway, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if deps.Clock == nil {
		deps.Clock = clockwork.NewRealClock()
	}
	if deps.Logger == nil {
		deps.Logger = slog.New(slog.DiscardHandler)
	}
	if deps.Registry == nil {
		deps.Registry = prometheus.NewRegistry()
	}
	keeperDB, err := newKeeperPool(deps.DB)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			keeperDB.Close()
		}
	}()
	client, err := coord.NewClient(keeperDB, deps.ID, coord.WithClock(deps.Clock))
	if err != nil {
		return nil, fmt.Errorf("gateway id: %w", err)
	}
	name := coord.GatewayLease(deps.ID)
	if err := coord.ValidateName(name); err != nil {
		return nil, err
	}
	m := newMetrics(deps.Registry)
	g := &Gateway{
		cfg: cfg, id: deps.ID, db: deps.DB, keeperDB: keeperDB, notifyURL: deps.NotifyURL, log: deps.Logger, clock: deps.Clock, m: m, watchers: outputWatchers{clock: deps.Clock},
		helloSlots:    helloSlotsFor(cfg.MaxPendingHellos, deps.DB.Config().MaxConns),
		limiter:       rate.NewLimiter(rate.Limit(cfg.HelloRate), cfg.HelloBurst),
		auths:         semaphore.NewWeighted(int64(cfg.MaxPendingAuths)),
		checker:       grpchealth.NewStaticChecker(nodev1connect.NodeGatewayServiceName),
		sessions:      map[string]*session{},
		tunnels:       tunnelTable{byID: map[string]*tunnel{}, byNode: map[string]int{}},
		fencedCh:      make(chan struct{}),
		dispatchWaker: newNodeWaker(), specWaker: newNodeWaker(), ingest: newIngester(deps.Clock),
		tracer:           tracing.TracerProvider(deps.Tracer).Tracer(tracerName),
		minDaemonVersion: buildinfo.Release(cfg.MinDaemonVersion),
	}
	g.helloRun = semaphore.NewWeighted(g.helloSlots)
	deps.Registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "leasehold_gateway_output_watchers", Help: "WatchOutput calls open now (the api's live readers of output past the stored cap).",
	}, func() float64 { return float64(g.watchers.n.Load()) }))
	if g.helloSlots < int64(cfg.MaxPendingHellos) {
		g.log.Info("Hello transactions capped at half the connection pool", "max_pending_hellos", cfg.MaxPendingHellos,
			"db_max_conns", deps.DB.Config().MaxConns, "hello_slots", g.helloSlots)
	}
	g.keeper, err = coord.NewKeeper(client, coord.KeeperConfig{
		Name: name, TTL: cfg.LeaseTTL, Renew: cfg.LeaseRenew, Trust: cfg.LeaseTTL / 2,
		OnAcquired:     g.leaseTaken,
		OnLost:         func(_ coord.Lease, reason string) { g.fence(reason) },
		ObserveRenewal: func(d time.Duration) { m.renewLatency.Observe(d.Seconds()) },
	}, deps.Logger)
	if err != nil {
		return nil, fmt.Errorf("gateway lease: %w", err)
	}
	g.checker.SetStatus(nodev1connect.NodeGatewayServiceName, grpchealth.StatusNotServing)
	g.checker.SetStatus("", grpchealth.StatusNotServing)
	if g.tls, err = loadTLS(cfg, deps); err != nil {
		return nil, err
	}
	if g.relayAuth, err = loadRelayAuth(cfg, deps); err != nil {
		return nil, err
	}
	if deps.Health != nil {
		deps.Health.AddReadiness("gateway", g.ready)
		deps.Health.AddDetail("gateway", func(context.Context) any { return g.detail() })
	}
	g.Service = services.NewBasicService(g.starting, g.running, nil).WithName("gateway")
	return g, nil
}

// ID is the gateway's id.
func (g *Gateway) ID() string { return g.id }

// Addr is the node stream address once started.
func (g *Gateway) Addr() string {
	if g.ln == nil {
		return ""
	}
	return g.ln.Addr().String()
}

// SessionCount is the number of sessions held.
func (g *Gateway) SessionCount() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.sessions)
}

// Fenced reports whether the gateway has fenced itself.
func (g *Gateway) Fenced() bool { return g.state.Load() == stateFenced }

func (g *Gateway) ready(context.Context) error {
	switch g.state.Load() {
	case stateServing:
		if _, ok := g.keeper.Current(); !ok {
			return errors.New("gateway lease not held")
		}
		return nil
	case stateDraining:
		return errors.New("gateway is draining")
	case stateFenced:
		g.fenceMu.Lock()
		reason := g.fenceReason
		g.fenceMu.Unlock()
		if err := g.keeper.Err(); err != nil {
			return fmt.Errorf("gateway fenced itself (%s); taking its lease again: %w", reason, err)
		}
		return fmt.Errorf("gateway fenced itself (%s); taking its lease again", reason)
	default:
		if err := g.keeper.Err(); err != nil {
			return fmt.Errorf("gateway lease not acquired yet: %w", err)
		}
		return errors.New("gateway lease not acquired yet")
	}
}

func (g *Gateway) detail() any {
	l, held := g.keeper.Current()
	return map[string]any{
		"id": g.id, "lease": l.Name, "epoch": l.Epoch, "held": held, "expires_at": l.ExpiresAt,
		"sessions": g.SessionCount(), "streams": g.streams.Load(), "pending_hellos": g.pending.Load(),
		"state":   [...]string{"starting", "serving", "draining", "fenced"}[g.state.Load()],
		"notify":  g.notifyURL != "",
		"tunnels": g.tunnelCount(),
	}
}

func (g *Gateway) starting(ctx context.Context) error {
	// The keeper runs for the life of the process, across fences; it stops
	// in running's exit path. A database that is not up yet is waited for.
	kctx, stop := context.WithCancel(context.Background())
	g.keeperStop, g.keeperDone = stop, make(chan struct{})
	acquired := g.keeper.Acquired()
	go func() { defer close(g.keeperDone); g.keeper.Run(kctx) }()
	started := false
	defer func() {
		if !started {
			g.stopKeeper()
			g.keeperDB.Close()
		}
	}()
	select {
	case <-acquired:
	case <-ctx.Done():
		return ctx.Err()
	}
	taken, _ := g.keeper.Current()
	g.fenceMu.Lock()
	g.servedEpoch = max(g.servedEpoch, taken.Epoch)
	g.fenceMu.Unlock()
	srv, err := g.newServer()
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", g.cfg.ListenAddr)
	if err != nil {
		return fmt.Errorf("listen on --listen-addr %s: %w", g.cfg.ListenAddr, err)
	}
	if err := g.startRelay(ctx); err != nil {
		_ = ln.Close()
		return err
	}
	g.ln, g.srv = ln, srv
	l, _ := g.keeper.Current()
	g.state.Store(stateServing)
	g.m.role.Set(health.RoleActive)
	g.checker.SetStatus(nodev1connect.NodeGatewayServiceName, grpchealth.StatusServing)
	g.checker.SetStatus("", grpchealth.StatusServing)
	g.log.Info("gateway serving", "addr", ln.Addr().String(), "lease", l.Name, "epoch", l.Epoch, "tls", g.cfg.TLSCert != "",
		"mtls", g.cfg.TLSClientCA != "", "bind_node_id", g.bindsNodeID(), "http2", g.cfg.HTTP2Server)
	started = true
	return nil
}

func (g *Gateway) running(ctx context.Context) error {
	defer g.keeperDB.Close() // after the keeper stopped and released the lease
	serveErr := make(chan error, 1)
	go func() { serveErr <- g.srv.Serve(g.ln) }()

	loopCtx, cancelLoops := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	for _, loop := range []func(context.Context){g.livenessLoop, g.dispatchLoop, g.notifyLoop, g.specLoop, g.ingestLoop, g.reloadLoop, g.loadLoop} {
		wg.Add(1)
		go func() { defer wg.Done(); loop(loopCtx) }()
	}
	stopLoops := func() { cancelLoops(); wg.Wait() }

	select {
	case <-ctx.Done():
		g.stopping.Store(true)
		g.stopRelay()
		g.drain(serveErr)
		stopLoops()
		g.stopKeeper()
		relCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := g.keeper.Release(relCtx); err != nil {
			g.log.Warn("release gateway lease", "err", err)
		} else {
			g.log.Info("gateway lease released", "lease", g.keeper.Name())
		}
		return nil
	case err := <-serveErr:
		// Not a database fault: the listener itself failed. Fence, let the
		// streams end, and exit non-zero so the supervisor restarts us.
		g.stopKeeper()
		g.keeper.Drop("node stream server failed")
		g.stopRelay()
		shutdownCtx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_ = g.srv.Shutdown(shutdownCtx)
		cancel()
		_ = g.srv.Close()
		stopLoops()
		return fmt.Errorf("node stream server: %w", err)
	}
}

func (g *Gateway) snapshot() []*session {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]*session, 0, len(g.sessions))
	for _, s := range g.sessions {
		out = append(out, s)
	}
	return out
}
