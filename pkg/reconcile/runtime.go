package reconcile

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jonboulle/clockwork"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/health"
	"github.com/leasehold/leasehold/pkg/queue"
)

// Runtime runs the reconcilers and jobs of one process.
type Runtime struct {
	*services.BasicService

	cfg      Config
	db       *pgxpool.Pool
	client   *coord.Client
	renewer  *coord.Renewer // set in starting, before running; read through Renewer() elsewhere
	renewerP atomic.Pointer[coord.Renewer]
	logger   *slog.Logger
	clock    clockwork.Clock
	m        *metrics
	reg      prometheus.Registerer
	notify   string

	sharded []Sharded

	jobsMu    sync.Mutex // guards jobs, jobCtx and jobCancel
	jobs      []Job
	jobCtx    context.Context
	jobCancel map[string]context.CancelFunc

	loopsMu sync.Mutex // guards loops
	loops   map[string]*health.Loop

	role      *health.RoleGauge
	stalled   chan string
	stallOnce sync.Once
	wg        sync.WaitGroup
}

// Options are the runtime's dependencies.
type Options struct {
	// Owner is the process id: lease owner and workers row id.
	Owner string
	// NotifyURL is a direct URL for LISTEN; "" polls only.
	NotifyURL string
	// Logger, Registerer and Clock default to discard, none and the real clock.
	Logger     *slog.Logger
	Registerer prometheus.Registerer
	Clock      clockwork.Clock
}

// New returns a runtime; register reconcilers and jobs before starting it.
func New(cfg Config, db *pgxpool.Pool, opts Options) (*Runtime, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if opts.Clock == nil {
		opts.Clock = clockwork.NewRealClock()
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	client, err := coord.NewClient(db, opts.Owner, coord.WithClock(opts.Clock))
	if err != nil {
		return nil, err
	}
	rt := &Runtime{
		cfg: cfg, db: db, client: client, logger: opts.Logger, clock: opts.Clock,
		m: newMetrics(opts.Registerer), reg: opts.Registerer, notify: opts.NotifyURL,
		loops: map[string]*health.Loop{}, stalled: make(chan string, 1), jobCancel: map[string]context.CancelFunc{},
	}
	if opts.Registerer != nil {
		rt.role = health.NewRoleGauge(opts.Registerer, "reconcile")
	}
	rt.BasicService = services.NewBasicService(rt.starting, rt.running, rt.stopping).WithName("reconcile")
	return rt, nil
}

// livenessConfig is the liveness session's configuration: on the direct
// (LISTEN) URL when there is one and liveness is on.
func (rt *Runtime) livenessConfig() coord.LivenessConfig {
	lc := rt.cfg.LivenessTimings
	if rt.cfg.Liveness {
		lc.URL = rt.notify
	}
	return lc
}

// Renewer is the process's renewal loop (nil before start). Safe to call
// from any goroutine, e.g. a health check served while the runtime starts.
func (rt *Runtime) Renewer() *coord.Renewer { return rt.renewerP.Load() }

// Client is the process's lease client.
func (rt *Runtime) Client() *coord.Client { return rt.client }

func (rt *Runtime) starting(ctx context.Context) error {
	groups := map[string]coord.Group{}
	var gs []coord.Group
	for _, s := range rt.sharded {
		if _, ok := groups[s.Group.Name]; !ok {
			groups[s.Group.Name] = s.Group
			gs = append(gs, s.Group)
		}
	}
	singletons := rt.Jobs()
	r, err := coord.NewRenewer(coord.RenewerConfig{
		Groups: gs, Singletons: singletons, Timings: rt.cfg.Timings, NotifyURL: rt.notify, Version: rt.cfg.Version,
		Liveness: rt.livenessConfig(),
	}, rt.client, rt.logger, rt.reg, rt.clock)
	if err != nil {
		return err
	}
	rt.renewer = r
	rt.renewerP.Store(r)
	if err := services.StartAndAwaitRunning(ctx, r); err != nil {
		return fmt.Errorf("start renewal loop: %w", err)
	}
	return nil
}

func (rt *Runtime) running(ctx context.Context) error {
	loopCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	for _, s := range rt.sharded {
		l := rt.newLoop("reconcile:" + s.Name)
		rt.wg.Add(1)
		go func() { defer rt.wg.Done(); rt.runSharded(loopCtx, s, l) }()
	}
	rt.jobsMu.Lock()
	rt.jobCtx = loopCtx
	jobs := append([]Job(nil), rt.jobs...)
	rt.jobsMu.Unlock()
	for _, j := range jobs {
		rt.startJob(j)
	}
	rt.wg.Add(1)
	go func() { defer rt.wg.Done(); rt.watch(loopCtx) }()

	<-ctx.Done()
	return nil
}

// stopping stops claiming, waits for running transactions, hands the claims
// back and then releases every lease (the renewer's own stop).
func (rt *Runtime) stopping(_ error) error {
	finished := make(chan struct{})
	go func() { rt.wg.Wait(); close(finished) }()
	select {
	case <-finished:
	case <-rt.clock.After(rt.cfg.SelfReleaseAfter):
		// A wedged reconcile must not keep the leases: release them anyway;
		// its transaction can no longer commit once they move.
		rt.logger.Warn("reconcile loops did not stop in time; releasing leases anyway", "waited", rt.cfg.SelfReleaseAfter)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if n, err := queue.ReleaseClaims(ctx, rt.db, rt.client.Owner()); err != nil {
		rt.logger.Warn("hand back claims on shutdown", "err", err)
	} else if n > 0 {
		rt.logger.Info("handed back claims", "count", n)
	}
	if rt.renewer != nil {
		return services.StopAndAwaitTerminated(context.Background(), rt.renewer)
	}
	return nil
}

func (rt *Runtime) fenceOptions() coord.FenceOptions {
	return coord.FenceOptions{StatementTimeout: rt.cfg.StatementTimeout, Now: rt.clock.Now}
}
