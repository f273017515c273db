// Package gateway serves node sessions (DESIGN.md section 8): Connect
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
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"connectrpc.com/grpchealth"
	"connectrpc.com/grpcreflect"
	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jonboulle/clockwork"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/time/rate"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasehold/leasehold/pkg/coord"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1/nodev1connect"
	"github.com/leasehold/leasehold/pkg/health"
	"github.com/leasehold/leasehold/pkg/reload"
	"github.com/leasehold/leasehold/pkg/tracing"
	"github.com/leasehold/leasehold/services/gateway/internal/h2serve"
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

	ln  net.Listener
	srv nodeServer

	state   atomic.Int32
	streams atomic.Int64
	pending atomic.Int64

	mu       sync.Mutex
	sessions map[string]*session

	dispatchWaker *nodeWaker
	specWaker     *nodeWaker

	// fenceMu orders fence and unfence; fencedCh is closed at each fence
	// (drain watches it) and replaced when serving resumes; generation
	// counts fences, so a Hello that straddled one is not registered.
	fenceMu     sync.Mutex
	fencedCh    chan struct{}
	fenceReason string
	generation  atomic.Uint64
	stopping    atomic.Bool // SIGTERM: a lease taken again no longer resumes serving
	keeperStop  context.CancelFunc
	keeperDone  chan struct{}

	slotMu   sync.Mutex
	nextSlot time.Time

	tls    *reload.TLS // nil: h2c
	tracer trace.Tracer
}

// New builds a gateway; it listens and takes its lease when started.
func New(cfg Config, deps Deps) (*Gateway, error) {
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
	client, err := coord.NewClient(deps.DB, deps.ID, coord.WithClock(deps.Clock))
	if err != nil {
		return nil, fmt.Errorf("gateway id: %w", err)
	}
	name := "gateway:" + deps.ID
	if err := coord.ValidateName(name); err != nil {
		return nil, err
	}
	m := newMetrics(deps.Registry)
	g := &Gateway{
		cfg: cfg, id: deps.ID, db: deps.DB, notifyURL: deps.NotifyURL, log: deps.Logger, clock: deps.Clock, m: m,
		limiter:       rate.NewLimiter(rate.Limit(cfg.HelloRate), cfg.HelloBurst),
		checker:       grpchealth.NewStaticChecker(nodev1connect.NodeGatewayServiceName),
		sessions:      map[string]*session{},
		fencedCh:      make(chan struct{}),
		dispatchWaker: newNodeWaker(), specWaker: newNodeWaker(),
		tracer: tracing.TracerProvider(deps.Tracer).Tracer(tracerName),
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
		"state":  [...]string{"starting", "serving", "draining", "fenced"}[g.state.Load()],
		"notify": g.notifyURL != "",
	}
}

func (g *Gateway) starting(ctx context.Context) error {
	// The keeper runs for the life of the process, across fences; it stops
	// in running's exit path. A database that is not up yet is waited for.
	kctx, stop := context.WithCancel(context.Background())
	g.keeperStop, g.keeperDone = stop, make(chan struct{})
	acquired := g.keeper.Acquired()
	go func() { defer close(g.keeperDone); g.keeper.Run(kctx) }()
	select {
	case <-acquired:
	case <-ctx.Done():
		g.stopKeeper()
		return ctx.Err()
	}
	srv, err := g.newServer()
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", g.cfg.ListenAddr)
	if err != nil {
		return fmt.Errorf("listen on --listen-addr %s: %w", g.cfg.ListenAddr, err)
	}
	g.ln, g.srv = ln, srv
	l, _ := g.keeper.Current()
	g.state.Store(stateServing)
	g.m.role.Set(health.RoleActive)
	g.checker.SetStatus(nodev1connect.NodeGatewayServiceName, grpchealth.StatusServing)
	g.checker.SetStatus("", grpchealth.StatusServing)
	g.log.Info("gateway serving", "addr", ln.Addr().String(), "lease", l.Name, "epoch", l.Epoch, "tls", g.cfg.TLSCert != "",
		"mtls", g.cfg.TLSClientCA != "", "bind_node_id", g.bindsNodeID(), "http2", g.cfg.HTTP2Server)
	return nil
}

type (
	bodyKey     struct{}
	tlsStateKey struct{}
)

// nodeServer is the HTTP/2 server of node streams: h2serve's (lean) or
// net/http's (std).
type nodeServer interface {
	Serve(ln net.Listener) error
	Shutdown(ctx context.Context) error
	Close() error
}

// stdServer serves TLS through ServeTLS when its TLSConfig is set.
type stdServer struct{ *http.Server }

func (s stdServer) Serve(ln net.Listener) error {
	if s.TLSConfig != nil {
		return s.ServeTLS(ln, "", "")
	}
	return s.Server.Serve(ln)
}

// Timings of node stream connections, on both servers.
const (
	readHeaderTimeout = 10 * time.Second
	connIdleTimeout   = 5 * time.Minute
	// A node host that vanishes sends no RST: ping idle connections.
	pingInterval = 15 * time.Second
	pingTimeout  = 5 * time.Second
	writeTimeout = 30 * time.Second
	// maxConnStreams is per connection; a daemon holds one stream.
	maxConnStreams = 16
	maxHeaderBytes = 64 << 10
)

// newServer builds the HTTP/2 server of node streams.
func (g *Gateway) newServer() (nodeServer, error) {
	mux := http.NewServeMux()
	path, h := nodev1connect.NewNodeGatewayServiceHandler(g,
		connect.WithReadMaxBytes(g.cfg.MaxMessageBytes),
		connect.WithSendMaxBytes(g.cfg.MaxMessageBytes),
		// Heartbeats and acks are tiny: compressing them costs a
		// compressor per stream and saves nothing.
		connect.WithCompressMinBytes(1024),
	)
	// Keep the request body reachable from the handler: closing it breaks
	// a pending Receive, which is how a session is closed from outside. The
	// TLS state (nil for h2c) carries the client certificate Hello is bound to.
	mux.Handle(path, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := context.WithValue(context.WithValue(r.Context(), bodyKey{}, r.Body), tlsStateKey{}, r.TLS)
		h.ServeHTTP(w, r.WithContext(ctx))
	}))
	mux.Handle(grpchealth.NewHandler(g.checker))
	reflector := grpcreflect.NewStaticReflector(nodev1connect.NodeGatewayServiceName, grpchealth.HealthV1ServiceName)
	mux.Handle(grpcreflect.NewHandlerV1(reflector))
	mux.Handle(grpcreflect.NewHandlerV1Alpha(reflector))

	tc, err := g.tlsConfig()
	if err != nil {
		return nil, err
	}
	if g.cfg.HTTP2Server == HTTP2Lean {
		return &h2serve.Server{
			Handler:              mux,
			TLSConfig:            tc,
			MaxConcurrentStreams: maxConnStreams,
			MaxHeaderListSize:    maxHeaderBytes,
			ReadHeaderTimeout:    readHeaderTimeout,
			WriteTimeout:         writeTimeout,
			PingInterval:         pingInterval,
			PingTimeout:          pingTimeout,
			IdleTimeout:          connIdleTimeout,
			Logger:               g.log,
		}, nil
	}
	protocols := new(http.Protocols)
	srv := &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: readHeaderTimeout,
		IdleTimeout:       connIdleTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(g.log.Handler(), slog.LevelDebug),
		Protocols:         protocols,
		HTTP2: &http.HTTP2Config{
			MaxConcurrentStreams: maxConnStreams,
			SendPingTimeout:      pingInterval,
			PingTimeout:          pingTimeout,
			WriteByteTimeout:     writeTimeout,
		},
	}
	if tc == nil {
		protocols.SetUnencryptedHTTP2(true) // h2c: loopback and tests
		return stdServer{srv}, nil
	}
	protocols.SetHTTP2(true)
	srv.TLSConfig = tc
	return stdServer{srv}, nil
}

func (g *Gateway) running(ctx context.Context) error {
	serveErr := make(chan error, 1)
	go func() { serveErr <- g.srv.Serve(g.ln) }()

	loopCtx, cancelLoops := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	for _, loop := range []func(context.Context){g.livenessLoop, g.dispatchLoop, g.notifyLoop, g.specLoop, g.reloadLoop} {
		wg.Add(1)
		go func() { defer wg.Done(); loop(loopCtx) }()
	}
	stopLoops := func() { cancelLoops(); wg.Wait() }

	select {
	case <-ctx.Done():
		g.stopping.Store(true)
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
		shutdownCtx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_ = g.srv.Shutdown(shutdownCtx)
		cancel()
		_ = g.srv.Close()
		stopLoops()
		return fmt.Errorf("node stream server: %w", err)
	}
}

func (g *Gateway) stopKeeper() {
	if g.keeperStop != nil {
		g.keeperStop()
		<-g.keeperDone
	}
}

// fence is the self-fence: refuse Hellos, close every stream UNAVAILABLE,
// answer not ready. It writes nothing to the database. The keeper has
// already dropped the lease (it calls fence through OnLost) and goes on
// taking it again; leaseTaken resumes serving.
func (g *Gateway) fence(reason string) {
	g.fenceMu.Lock()
	defer g.fenceMu.Unlock()
	if g.Fenced() {
		return
	}
	g.generation.Add(1)
	g.fenceReason = reason
	g.state.Store(stateFenced)
	g.m.role.Set(health.RoleFenced)
	g.m.selfFences.Inc()
	g.checker.SetStatus(nodev1connect.NodeGatewayServiceName, grpchealth.StatusNotServing)
	g.checker.SetStatus("", grpchealth.StatusNotServing)
	g.log.Error("gateway fenced itself: closing every stream; it serves again once it holds its lease at a new epoch",
		"reason", reason, "lease", g.keeper.Name())
	for _, s := range g.snapshot() {
		s.close(connect.NewError(connect.CodeUnavailable, fmt.Errorf("gateway %s fenced itself: %s", g.id, reason)))
	}
	close(g.fencedCh)
}

// leaseTaken is the keeper's OnAcquired: at start nothing happens (starting
// goes on); after a fence the gateway serves again at the new epoch.
func (g *Gateway) leaseTaken(l coord.Lease) {
	g.fenceMu.Lock()
	defer g.fenceMu.Unlock()
	if !g.Fenced() || g.stopping.Load() {
		return
	}
	g.fencedCh = make(chan struct{})
	g.state.Store(stateServing)
	g.m.role.Set(health.RoleActive)
	g.checker.SetStatus(nodev1connect.NodeGatewayServiceName, grpchealth.StatusServing)
	g.checker.SetStatus("", grpchealth.StatusServing)
	g.log.Info("gateway serving again", "lease", l.Name, "epoch", l.Epoch, "fenced_for", g.fenceReason)
	g.wakeDispatch("")
}

// fenced returns a channel closed at the next fence.
func (g *Gateway) fenced() <-chan struct{} {
	g.fenceMu.Lock()
	defer g.fenceMu.Unlock()
	return g.fencedCh
}

// runFenced runs fn fenced on the gateway lease; a fence that finds the
// lease lost fences the gateway (through the keeper's OnLost).
func (g *Gateway) runFenced(ctx context.Context, fn func(ctx context.Context, tx pgxTx) error) error {
	err := g.keeper.RunFenced(ctx, g.db, fn)
	if errors.Is(err, coord.ErrLeaseLost) {
		g.m.fenceFailures.Inc()
	}
	if err != nil {
		return fmt.Errorf("fenced on %s: %w", g.keeper.Name(), err)
	}
	return nil
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

// drain sends every node Drain with a random delay up to DrainMaxDelay,
// stops accepting streams, and returns when the streams are gone or
// DrainMaxDelay + DrainGrace has passed (then closes the rest).
func (g *Gateway) drain(serveErr <-chan error) {
	if !g.state.CompareAndSwap(stateServing, stateDraining) {
		_ = g.srv.Close()
		return
	}
	g.checker.SetStatus(nodev1connect.NodeGatewayServiceName, grpchealth.StatusNotServing)
	g.checker.SetStatus("", grpchealth.StatusNotServing)
	sessions := g.snapshot()
	g.log.Info("draining", "sessions", len(sessions), "max_delay", g.cfg.DrainMaxDelay)
	for _, s := range sessions {
		s.enqueue(drainMessage(g.cfg.DrainMaxDelay))
	}
	deadline := g.clock.After(g.cfg.DrainMaxDelay + g.cfg.DrainGrace)
	shutdownCtx, cancel := context.WithCancel(context.Background())
	defer cancel()
	shutdownDone := make(chan struct{})
	go func() {
		// Closes the listener, sends GOAWAY, and waits for open streams.
		_ = g.srv.Shutdown(shutdownCtx)
		close(shutdownDone)
	}()
	tick := g.clock.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	fenced := g.fenced()
wait:
	for g.streams.Load() > 0 || g.SessionCount() > 0 {
		select {
		case <-deadline:
			break wait
		case <-fenced:
			break wait
		case <-tick.Chan():
		}
	}
	left := g.snapshot()
	if len(left) > 0 {
		g.log.Warn("drain deadline passed; closing remaining streams", "sessions", len(left))
	}
	for _, s := range left {
		s.close(connect.NewError(connect.CodeUnavailable, errors.New("gateway drained")))
	}
	cancel()
	<-shutdownDone
	_ = g.srv.Close()
	<-serveErr
	g.log.Info("drained")
}

func drainMessage(maxDelay time.Duration) *nodev1.ConnectResponse {
	var d time.Duration
	if maxDelay > 0 {
		d = rand.N(maxDelay + 1)
	}
	return &nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Drain{Drain: &nodev1.Drain{
		Delay: durationpb.New(d), Reason: "gateway shutting down",
	}}}
}
