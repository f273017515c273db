package coord

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5"
	"github.com/jonboulle/clockwork"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasehold/leasehold/pkg/health"
)

// RenewerConfig configures a process's renewal loop.
type RenewerConfig struct {
	// Groups are the membership groups whose shards this process takes:
	// those with at least one sharded reconciler registered. Empty: the
	// process heartbeats in Singletons and holds no shard lease.
	Groups []Group
	// Singletons are the singleton lease names to take wherever free.
	Singletons []string
	// Timings are the lease and membership durations.
	Timings Timings
	// NotifyURL is a direct URL for LISTEN; "" polls only.
	NotifyURL string
	// Version is reported on the workers row.
	Version string
	// Liveness configures the liveness session (liveness.go); an empty URL
	// leaves the TTL path alone.
	Liveness LivenessConfig
}

// Renewer is the lease-renewal loop of one process (docs/design.md#membership
// and #handover): on its own timer, never inside a reconcile, it heartbeats,
// plans the shards of each group by rendezvous hashing, releases what it no
// longer owns and acquires or renews everything else in one statement per
// pass.
type Renewer struct {
	*services.BasicService

	cfg    RenewerConfig
	client *Client
	logger *slog.Logger
	clock  clockwork.Clock
	m      *metrics
	loop   *health.Loop
	skew   *SkewDetector
	host   string

	trigger chan string
	halted  atomic.Bool
	live    *livenessSession // nil with liveness off

	mu          sync.RWMutex
	held        map[string]Lease // by name
	lastPass    time.Time
	orphanWake  time.Time
	notifyMode  string
	lastMembers map[string][]Member
	changed     chan struct{}
	passErr     error          // the last pass's error; nil after a successful pass
	planned     map[string]int // shards of each group the last pass planned for this process
}

// NewRenewer builds the renewal loop for client's owner.
func NewRenewer(cfg RenewerConfig, client *Client, logger *slog.Logger, reg prometheus.Registerer, clock clockwork.Clock) (*Renewer, error) {
	if err := cfg.Timings.Validate(); err != nil {
		return nil, err
	}
	for _, n := range cfg.Singletons {
		if err := ValidateName(n); err != nil {
			return nil, err
		}
	}
	if err := cfg.Liveness.Validate(cfg.Timings.LeaseTTL); err != nil {
		return nil, err
	}
	if clock == nil {
		clock = clockwork.NewRealClock()
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	host, _ := os.Hostname()
	r := &Renewer{
		cfg: cfg, client: client, logger: logger, clock: clock, m: newMetrics(reg), host: host,
		trigger: make(chan string, 1), held: map[string]Lease{}, lastMembers: map[string][]Member{},
		changed: make(chan struct{}), notifyMode: "polling",
	}
	if cfg.Liveness.URL != "" {
		groups := []string{Singletons.Name}
		for _, g := range cfg.Groups {
			groups = append(groups, g.Name)
		}
		r.live = &livenessSession{cfg: cfg.Liveness, owner: client.Owner(), groups: groups, db: client.db, clock: clock,
			log: logger, m: r.m, onPeer: func() { r.Trigger("liveness-takeover") }, deadSince: map[string]time.Time{}}
	}
	r.skew = NewSkewDetector(DefaultSkewThreshold, logger, func(d time.Duration) { r.m.clockSkew.Set(d.Seconds()) })
	client.skew = r.skew
	client.adoptLogger(logger)
	// The renewal loop stalls when a pass has not completed for a full TTL.
	r.loop = health.NewLoop("lease-renewal", cfg.Timings.LeaseTTL, clock.Now)
	r.BasicService = services.NewBasicService(nil, r.running, r.stopping).WithName("lease-renewal")
	return r, nil
}

// Loop is the renewal loop's progress watchdog, for /livez.
func (r *Renewer) Loop() *health.Loop { return r.loop }

// Skew is the process's clock-skew detector.
func (r *Renewer) Skew() *SkewDetector { return r.skew }

// Trigger asks for a pass as soon as possible.
func (r *Renewer) Trigger(reason string) {
	select {
	case r.trigger <- reason:
	default:
	}
}

func (r *Renewer) running(ctx context.Context) error {
	if r.live != nil {
		lctx, cancel := context.WithCancel(ctx)
		defer cancel()
		done := make(chan struct{})
		defer func() { cancel(); <-done }()
		go func() { defer close(done); r.live.run(lctx) }()
	}
	if url := r.cfg.NotifyURL; url != "" {
		lctx, cancel := context.WithCancel(ctx)
		defer cancel()
		done := make(chan struct{})
		defer func() { cancel(); <-done }()
		go func() { defer close(done); r.listen(lctx, url) }()
	}
	tick := r.clock.NewTicker(r.cfg.Timings.Tick())
	defer tick.Stop()
	// A pass is not cancelled by the stop: it ends by itself within its
	// own bound (a third of the TTL). Cancelling it would abandon its
	// heartbeat on the client while the server may still run it (a cancel
	// request that lands before the backend reads the statement cancels
	// nothing), and a heartbeat that commits after stopping's Leave puts
	// the member's row back: survivors would plan shards for a member that
	// is gone. Waiting for the pass orders the Leave after it.
	passCtx := context.WithoutCancel(ctx)
	r.pass(passCtx, "start")
	for {
		select {
		case <-ctx.Done():
			return nil
		case reason := <-r.trigger:
			r.pass(passCtx, reason)
		case <-tick.Chan():
			if reason, due := r.due(); due {
				r.pass(passCtx, reason)
			}
		}
	}
}

// due decides whether a tick runs a pass: every Renew, when a held lease has
// under a third of its TTL of validity left, or at a scheduled orphan attempt.
func (r *Renewer) due() (string, bool) {
	now := r.clock.Now()
	r.mu.RLock()
	defer r.mu.RUnlock()
	if now.Sub(r.lastPass) >= r.cfg.Timings.Renew {
		return "period", true
	}
	if !r.orphanWake.IsZero() && !now.Before(r.orphanWake) {
		return "orphan-expiry", true
	}
	for _, l := range r.held {
		if l.ValidUntil.Sub(now) < l.TTL/3 {
			return "expiring", true
		}
	}
	return "", false
}

// pass is one membership pass. Errors are logged and counted: the next tick
// retries, and leases stay trusted only until their ValidUntil.
func (r *Renewer) pass(ctx context.Context, trigger string) {
	if r.halted.Load() {
		return // self-released: never take a lease again; /livez fails
	}
	r.m.passes.WithLabelValues(trigger).Inc()
	start := r.clock.Now()
	var (
		gen     uint64
		flagged bool
	)
	if r.live != nil {
		gen, flagged = r.live.generation(), r.live.up()
	}
	if err := r.doPass(ctx, flagged); err != nil {
		if ctx.Err() != nil {
			return
		}
		r.setPassErr(err)
		r.m.renewFails.Inc()
		if Unreachable(err) {
			// Waiting for the database is not a stall: a restart would not
			// bring it back. Leases stay trusted only until ValidUntil.
			r.loop.Wait("database unreachable: " + err.Error())
			r.logger.Warn("membership pass failed: database unreachable; retrying", "trigger", trigger, "held", len(r.Held()), "err", err)
			return
		}
		r.logger.Warn("membership pass failed", "trigger", trigger, "err", err)
		return
	}
	r.setPassErr(nil)
	if r.live != nil {
		// The leases this pass returned are ours under the session that
		// was up when it began (or, with it down, under the TTL path).
		r.live.passed(gen, flagged)
	}
	r.loop.Beat()
	r.logger.Debug("membership pass", "trigger", trigger, "took", r.clock.Since(start), "held", len(r.held))
}

func (r *Renewer) doPass(ctx context.Context, liveness bool) error {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.Timings.LeaseTTL/3)
	defer cancel()
	t := r.cfg.Timings
	skew, _ := r.skew.Last()
	info := HeartbeatInfo{ProcessID: r.client.Owner(), Hostname: r.host, Version: r.cfg.Version,
		ClockSkew: skew, NotifyMode: r.NotifyMode(), LeasesHeld: len(r.Held()), Liveness: liveness}

	groups := r.cfg.Groups
	if len(groups) == 0 {
		groups = []Group{Singletons}
	}
	var want, release []string
	var silentAt time.Time // when a quiet member will count as silent
	planned := map[string]int{}
	orphanNames := map[string]bool{}
	members := map[string][]Member{}
	for _, g := range groups {
		ms, err := Heartbeat(ctx, r.client.db, g, g.RowID(r.client.Owner()), info, t)
		if err != nil {
			return err
		}
		members[g.Name] = ms
		r.m.liveMembers.WithLabelValues(g.Name).Set(float64(len(ms)))
		if !g.Shards {
			continue
		}
		held := map[int]bool{}
		for _, n := range r.Shards(g) {
			held[n] = true
		}
		plan := PlanShards(g.RowID(r.client.Owner()), ms, held, t.LeaseTTL)
		for _, m := range ms {
			// A member quiet for longer than a renewal period may have
			// crashed: look again the moment it would count as silent,
			// rather than at the next period after that.
			if m.ID != g.RowID(r.client.Owner()) && m.Age > t.Renew && m.Age <= t.LeaseTTL {
				at := r.clock.Now().Add(t.LeaseTTL - m.Age + time.Millisecond)
				if silentAt.IsZero() || at.Before(silentAt) {
					silentAt = at
				}
			}
		}
		planned[g.Name] = len(plan.Mine)
		for _, s := range plan.Mine {
			want = append(want, g.ShardLease(s))
		}
		for _, s := range plan.Orphans {
			want = append(want, g.ShardLease(s))
			orphanNames[g.ShardLease(s)] = true
		}
		for _, s := range plan.Release {
			release = append(release, g.ShardLease(s))
		}
	}
	want = append(want, r.singletons()...)

	if len(release) > 0 {
		released, err := r.client.Release(ctx, release...)
		if err != nil {
			return err
		}
		r.forget(released...)
		r.logger.Info("released shards no longer owned", "count", len(released))
	}
	if len(want) == 0 {
		r.finishPass(members, planned, silentAt)
		return nil
	}
	sent := r.clock.Now()
	grant, err := r.client.AcquireMany(ctx, want, t.LeaseTTL)
	r.m.renewSeconds.Observe(r.clock.Since(sent).Seconds())
	if err != nil {
		return err
	}
	r.apply(grant, want)

	// Orphans still held live by a silent owner: try again the moment their
	// lease expires, rather than at the next period.
	var pending []string
	for n := range orphanNames {
		if _, ok := grant.Get(n); !ok {
			pending = append(pending, n)
		}
	}
	wake := silentAt
	if len(pending) > 0 {
		expiry, err := r.orphanExpiry(ctx, pending, grant)
		if err != nil {
			return err
		}
		if !expiry.IsZero() && (wake.IsZero() || expiry.Before(wake)) {
			wake = expiry
		}
	}
	r.finishPass(members, planned, wake)
	return nil
}

func (r *Renewer) orphanExpiry(ctx context.Context, names []string, g Grant) (time.Time, error) {
	var earliest time.Time
	err := r.client.db.QueryRow(ctx, "SELECT min(expires_at) FROM leases WHERE name = ANY($1::text[]) AND expires_at > $2",
		names, g.Now).Scan(&earliest)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, fmt.Errorf("read orphan expiry: %w", err)
	}
	if earliest.IsZero() {
		return time.Time{}, nil
	}
	// Map the database instant onto the process clock through the skew
	// sample, plus a millisecond so the attempt lands after expiry.
	return earliest.Add(g.Skew + time.Millisecond), nil
}

func (r *Renewer) finishPass(members map[string][]Member, planned map[string]int, orphanWake time.Time) {
	r.mu.Lock()
	r.planned = planned
	r.lastPass = r.clock.Now()
	r.orphanWake = orphanWake
	r.lastMembers = members
	r.mu.Unlock()
}

// stopping releases every lease this process holds and deletes its workers
// rows, so survivors take over on their next pass (at once, through NOTIFY).
func (r *Renewer) stopping(_ error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	groups := r.cfg.Groups
	if len(groups) == 0 {
		groups = []Group{Singletons}
	}
	ids := make([]string, len(groups))
	for i, g := range groups {
		ids[i] = g.RowID(r.client.Owner())
	}
	released, err := r.client.LeaveAndReleaseAll(ctx, ids)
	if err != nil {
		r.logger.Warn("release on shutdown failed; leases will expire", "err", err)
		return nil
	}
	r.forget(released...)
	r.logger.Info("released leases and left membership", "released", len(released))
	return nil
}

// SelfRelease gives up every lease at once (a process whose loop stalled
// while the database answered), so a successor need not wait for the TTL,
// and halts the loop for good: it takes no lease again and its liveness
// check fails, so the process is restarted. A database outage never leads
// here: passes that cannot reach the database count as waiting (Unreachable).
func (r *Renewer) SelfRelease(ctx context.Context) ([]string, error) {
	r.halted.Store(true)
	released, err := r.client.ReleaseAll(ctx)
	r.forget(released...)
	return released, err
}
