package reconcile

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jonboulle/clockwork"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/health"
	"github.com/leasehold/leasehold/pkg/queue"
)

// Func reconciles one key inside a transaction fenced on its shard's lease.
// Returning an error rolls the transaction back and retries the key later.
type Func func(ctx context.Context, tx pgx.Tx, key string) error

// Sharded is a sharded reconciler: keys of the work queue under Name, spread
// over the 256 shards of Group.
type Sharded struct {
	// Name is the work_queue.reconciler value.
	Name string
	// Group is the membership group whose shard leases fence it.
	Group coord.Group
	// Reconcile handles one key.
	Reconcile Func
}

type leaseKey struct{}

// LeaseFrom returns the shard lease a sharded reconcile runs under (its
// epoch is the fencing token to record, e.g. on an allocation).
func LeaseFrom(ctx context.Context) (coord.Lease, bool) {
	l, ok := ctx.Value(leaseKey{}).(coord.Lease)
	return l, ok
}

// Job runs while its process holds the job's lease. ctx ends when the lease
// is lost, released or the process stops; every write goes through
// jc.RunFenced, fenced on the lease at the epoch the job started with.
type Job struct {
	// Name is the job's name; its lease is singleton:<Name> unless Lease is set.
	Name string
	// Lease overrides the lease name (e.g. metrics:command-latency).
	Lease string
	// Run works until ctx ends.
	Run func(ctx context.Context, jc *JobContext) error
}

// JobContext is what a running job gets: its lease and a fenced-transaction
// helper that always uses the latest renewal of that lease.
type JobContext struct {
	// Lease is the lease as taken when the job started.
	Lease coord.Lease
	rt    *Runtime
}

// Current returns the lease as last renewed, or ErrLeaseLost once it is no
// longer held at the job's epoch.
func (jc *JobContext) Current() (coord.Lease, error) {
	l, ok := jc.rt.renewer.Lease(jc.Lease.Name)
	if !ok || l.Epoch != jc.Lease.Epoch {
		return coord.Lease{}, &coord.LeaseLostError{Name: jc.Lease.Name, Epoch: jc.Lease.Epoch}
	}
	return l, nil
}

// RunFenced runs fn in a transaction fenced on the job's lease.
func (jc *JobContext) RunFenced(ctx context.Context, fn func(ctx context.Context, tx pgx.Tx) error) error {
	l, err := jc.Current()
	if err != nil {
		return err
	}
	return coord.RunFenced(ctx, jc.rt.db, l, jc.rt.fenceOptions(), fn)
}

// DB is the runtime's pool, for reads outside fenced transactions.
func (jc *JobContext) DB() *pgxpool.Pool { return jc.rt.db }

func (rt *Runtime) fenceOptions() coord.FenceOptions {
	return coord.FenceOptions{StatementTimeout: rt.cfg.StatementTimeout, Now: rt.clock.Now}
}

// LeaseName is the job's lease.
func (j Job) LeaseName() string {
	if j.Lease != "" {
		return j.Lease
	}
	return "singleton:" + j.Name
}

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

	sharded   []Sharded
	jobsMu    sync.Mutex
	jobs      []Job
	jobCtx    context.Context
	jobCancel map[string]context.CancelFunc
	loops     map[string]*health.Loop

	role       *health.RoleGauge
	stalled    chan string
	stallOnce  sync.Once
	wg         sync.WaitGroup
	inflightMu sync.Mutex
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

// RegisterSharded adds a sharded reconciler. Call before starting.
func (rt *Runtime) RegisterSharded(s Sharded) error {
	if err := queue.ValidateReconciler(s.Name); err != nil {
		return err
	}
	if s.Reconcile == nil || !s.Group.Shards {
		return fmt.Errorf("sharded reconciler %s: needs a Reconcile func and a sharded group", s.Name)
	}
	rt.sharded = append(rt.sharded, s)
	return nil
}

// RegisterJob adds a singleton job. Before start it is part of the first
// pass; while running it starts being taken from the next pass on.
func (rt *Runtime) RegisterJob(j Job) error {
	if err := coord.ValidateName(j.LeaseName()); err != nil {
		return fmt.Errorf("job %s: %w", j.Name, err)
	}
	if j.Run == nil {
		return fmt.Errorf("job %s: needs a Run func", j.Name)
	}
	for _, name := range rt.Jobs() {
		if name == j.LeaseName() {
			return fmt.Errorf("job %s: lease %s registered twice", j.Name, j.LeaseName())
		}
	}
	rt.jobsMu.Lock()
	rt.jobs = append(rt.jobs, j)
	running := rt.jobCtx != nil
	rt.jobsMu.Unlock()
	if running {
		if err := rt.renewer.AddSingleton(j.LeaseName()); err != nil {
			return err
		}
		rt.startJob(j)
	}
	return nil
}

// RemoveJob stops a running singleton job and releases its lease.
func (rt *Runtime) RemoveJob(ctx context.Context, leaseName string) error {
	rt.jobsMu.Lock()
	cancel := rt.jobCancel[leaseName]
	delete(rt.jobCancel, leaseName)
	kept := rt.jobs[:0:0]
	for _, j := range rt.jobs {
		if j.LeaseName() != leaseName {
			kept = append(kept, j)
		}
	}
	rt.jobs = kept
	rt.jobsMu.Unlock()
	if cancel != nil {
		cancel()
	}
	r := rt.Renewer() // may run while the runtime starts
	if r == nil {
		return nil
	}
	return r.RemoveSingleton(ctx, leaseName)
}

// Jobs returns the lease names of the registered jobs.
func (rt *Runtime) Jobs() []string {
	rt.jobsMu.Lock()
	defer rt.jobsMu.Unlock()
	out := make([]string, len(rt.jobs))
	for i, j := range rt.jobs {
		out[i] = j.LeaseName()
	}
	return out
}

func (rt *Runtime) startJob(j Job) {
	rt.jobsMu.Lock()
	ctx, cancel := context.WithCancel(rt.jobCtx)
	rt.jobCancel[j.LeaseName()] = cancel
	rt.jobsMu.Unlock()
	rt.wg.Add(1)
	go func() { defer rt.wg.Done(); rt.superviseJob(ctx, j) }()
}

// Renewer is the process's renewal loop (nil before start). Safe to call
// from any goroutine, e.g. a health check served while the runtime starts.
func (rt *Runtime) Renewer() *coord.Renewer { return rt.renewerP.Load() }

// Client is the process's lease client.
func (rt *Runtime) Client() *coord.Client { return rt.client }

// AddHealth registers the runtime's liveness checks (every loop) and
// readiness (the first pass done) on h, and its detail section.
func (rt *Runtime) AddHealth(h *health.Handler) {
	h.AddLiveness("reconcile", func(ctx context.Context) error {
		r := rt.Renewer()
		if r == nil {
			return nil
		}
		if err := r.Loop().Check(ctx); err != nil {
			return err
		}
		for _, l := range rt.loopList() {
			if err := l.Check(ctx); err != nil {
				return err
			}
		}
		return nil
	})
	// Ready while the runtime runs, the database answers and the process
	// holds what it should (Renewer.Ready); not ready during an outage, and
	// ready again by itself once the next pass succeeds.
	h.AddReadiness("leases", func(ctx context.Context) error {
		if rt.State() != services.Running {
			return fmt.Errorf("runtime is %s", rt.State())
		}
		if rt.stalledOut() {
			return errors.New("a loop stalled and every lease was released")
		}
		return rt.Renewer().Ready()
	})
	h.AddDetail("leases", func(ctx context.Context) any {
		r := rt.Renewer()
		if r == nil {
			return nil
		}
		return r.Detail(ctx)
	})
}

func (rt *Runtime) loopList() []*health.Loop {
	rt.inflightMu.Lock()
	defer rt.inflightMu.Unlock()
	out := make([]*health.Loop, 0, len(rt.loops))
	for _, l := range rt.loops {
		out = append(out, l)
	}
	return out
}

func (rt *Runtime) newLoop(name string) *health.Loop {
	l := health.NewLoop(name, rt.cfg.SelfReleaseAfter, rt.clock.Now)
	rt.inflightMu.Lock()
	rt.loops[name] = l
	rt.inflightMu.Unlock()
	return l
}

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

// watch self-releases when the renewal loop or a reconcile loop stalls, and
// exports queue depth.
func (rt *Runtime) watch(ctx context.Context) {
	tick := rt.clock.NewTicker(max(rt.cfg.Timings.Tick(), time.Second))
	defer tick.Stop()
	lastDepth := time.Time{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.Chan():
		}
		loops := append(rt.loopList(), rt.renewer.Loop())
		for _, l := range loops {
			if l.Age() > rt.cfg.SelfReleaseAfter {
				rt.selfRelease(ctx, l)
			}
		}
		rt.exportRole()
		if rt.clock.Since(lastDepth) >= 5*time.Second && len(rt.sharded) > 0 {
			lastDepth = rt.clock.Now()
			rt.exportDepth(ctx)
		}
	}
}

// exportRole sets leasehold_role{component="reconcile"}: fenced after a
// self-release, active while any lease is held, standby otherwise.
func (rt *Runtime) exportRole() {
	if rt.role == nil {
		return
	}
	switch {
	case rt.stalledOut():
		rt.role.Set(health.RoleFenced)
	case len(rt.renewer.Held()) > 0:
		rt.role.Set(health.RoleActive)
	default:
		rt.role.Set(health.RoleStandby)
	}
}

func (rt *Runtime) selfRelease(ctx context.Context, l *health.Loop) {
	rt.stallOnce.Do(func() {
		close(rt.stalled) // reconcile loops stop claiming
		rt.m.selfReleases.Inc()
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		released, err := rt.renewer.SelfRelease(rctx)
		rt.logger.Error("loop stalled while the database answered: released every lease; /livez now fails so the supervisor restarts this process",
			"loop", l.Name(), "stalled_for", l.Age().Round(time.Millisecond), "released", len(released), "err", err)
	})
}

func (rt *Runtime) exportDepth(ctx context.Context) {
	dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	stats, err := queue.Depth(dctx, rt.db)
	if err != nil {
		return
	}
	for _, s := range rt.sharded {
		st := stats[s.Name]
		rt.m.queueDepth.WithLabelValues(s.Name).Set(float64(st.Total))
		rt.m.queueOverdue.WithLabelValues(s.Name).Set(float64(st.Overdue))
	}
}

// runSharded is one reconciler's claim loop.
func (rt *Runtime) runSharded(ctx context.Context, s Sharded, loop *health.Loop) {
	for {
		loop.Beat()
		if rt.stalledOut() {
			return
		}
		shards := rt.renewer.Shards(s.Group)
		var items []queue.Item
		if len(shards) > 0 {
			// Bounded, so a database that stops answering leaves the loop
			// waiting rather than stuck (a stuck loop would self-release).
			cctx, cancel := context.WithTimeout(ctx, rt.cfg.StatementTimeout)
			var err error
			items, err = queue.Claim(cctx, rt.db, s.Name, rt.client.Owner(), shards, rt.cfg.Batch, rt.cfg.ClaimTTL)
			cancel()
			switch {
			case err == nil, ctx.Err() != nil:
			case coord.Unreachable(err):
				loop.Wait("database unreachable: " + err.Error())
				rt.logger.Warn("claim failed: database unreachable", "reconciler", s.Name, "err", err)
			default:
				rt.logger.Warn("claim failed", "reconciler", s.Name, "err", err)
			}
		}
		for _, it := range items {
			if ctx.Err() != nil {
				return
			}
			rt.runOne(ctx, s, it)
			loop.Beat()
		}
		if len(items) == rt.cfg.Batch {
			continue // more may be due
		}
		select {
		case <-ctx.Done():
			return
		case <-rt.renewer.Changed():
		case <-rt.clock.After(rt.cfg.Poll):
		}
	}
}

func (rt *Runtime) stalledOut() bool {
	select {
	case <-rt.stalled:
		return true
	default:
		return false
	}
}

func (rt *Runtime) runOne(ctx context.Context, s Sharded, it queue.Item) {
	lease, ok := rt.renewer.Lease(s.Group.ShardLease(it.Shard))
	if !ok {
		// The shard moved since the claim: leave the key to the new holder.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		_, _ = queue.ReleaseClaim(rctx, rt.db, it)
		return
	}
	start := rt.clock.Now()
	err := coord.RunFenced(ctx, rt.db, lease, rt.fenceOptions(),
		func(ctx context.Context, tx pgx.Tx) error {
			ctx = context.WithValue(ctx, leaseKey{}, lease)
			if err := s.Reconcile(ctx, tx, it.Key); err != nil {
				return err
			}
			_, err := queue.Complete(ctx, tx, it)
			return err
		})
	rt.m.runSeconds.WithLabelValues(s.Name).Observe(rt.clock.Since(start).Seconds())
	switch {
	case err == nil:
		rt.m.runs.WithLabelValues(s.Name, "ok").Inc()
	case errors.Is(err, coord.ErrLeaseLost):
		rt.m.runs.WithLabelValues(s.Name, "lease_lost").Inc()
		rt.m.fenceFailures.WithLabelValues("shard").Inc()
		rt.logger.Warn("reconcile refused by the fence: shard lease lost", "reconciler", s.Name, "key", it.Key, "lease", lease.Name, "epoch", lease.Epoch)
	case ctx.Err() != nil:
		// Stopping: the claim is handed back on the way out.
	default:
		rt.m.runs.WithLabelValues(s.Name, "error").Inc()
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		due, ferr := queue.Fail(fctx, rt.db, it, err, rt.cfg.Backoff)
		rt.logger.Warn("reconcile failed; retrying later", "reconciler", s.Name, "key", it.Key, "attempts", it.Attempts, "retry_at", due, "err", err, "record_err", ferr)
	}
}
