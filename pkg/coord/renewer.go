package coord

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgxlisten"
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
}

// Renewer is the lease-renewal loop of one process (DESIGN.md sections 5
// and 7): on its own timer, never inside a reconcile, it heartbeats, plans
// the shards of each group by rendezvous hashing, releases what it no longer
// owns and acquires or renews everything else in one statement per pass.
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
	r.skew = NewSkewDetector(DefaultSkewThreshold, logger, func(d time.Duration) { r.m.clockSkew.Set(d.Seconds()) })
	client.skew = r.skew
	// The renewal loop stalls when a pass has not completed for a full TTL.
	r.loop = health.NewLoop("lease-renewal", cfg.Timings.LeaseTTL, clock.Now)
	r.BasicService = services.NewBasicService(nil, r.running, r.stopping).WithName("lease-renewal")
	return r, nil
}

func (r *Renewer) singletons() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return append([]string(nil), r.cfg.Singletons...)
}

// AddSingleton starts taking singleton lease name from the next pass on.
func (r *Renewer) AddSingleton(name string) error {
	if err := ValidateName(name); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.cfg.Singletons {
		if s == name {
			return nil
		}
	}
	r.cfg.Singletons = append(r.cfg.Singletons, name)
	r.Trigger("singleton-added")
	return nil
}

// RemoveSingleton stops taking name and releases it if held, so another
// process need not wait for the TTL (a deleted sink, say).
func (r *Renewer) RemoveSingleton(ctx context.Context, name string) error {
	r.mu.Lock()
	kept := r.cfg.Singletons[:0:0]
	for _, s := range r.cfg.Singletons {
		if s != name {
			kept = append(kept, s)
		}
	}
	r.cfg.Singletons = kept
	r.mu.Unlock()
	released, err := r.client.Release(ctx, name)
	r.forget(released...)
	return err
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

// Lease returns the held lease called name while it is still valid on the
// process clock.
func (r *Renewer) Lease(name string) (Lease, bool) {
	r.mu.RLock()
	l, ok := r.held[name]
	r.mu.RUnlock()
	if !ok || !r.clock.Now().Before(l.ValidUntil) {
		return Lease{}, false
	}
	return l, true
}

// Shards returns the shards of g this process holds validly, sorted.
func (r *Renewer) Shards(g Group) []int {
	now := r.clock.Now()
	r.mu.RLock()
	defer r.mu.RUnlock()
	var out []int
	for name, l := range r.held {
		if n, ok := g.ShardOfLease(name); ok && now.Before(l.ValidUntil) {
			out = append(out, n)
		}
	}
	sort.Ints(out)
	return out
}

// Held returns every lease held validly now.
func (r *Renewer) Held() []Lease {
	now := r.clock.Now()
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]Lease, 0, len(r.held))
	for _, l := range r.held {
		if now.Before(l.ValidUntil) {
			out = append(out, l)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Changed returns a channel closed at the next change of the held set.
func (r *Renewer) Changed() <-chan struct{} {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.changed
}

// NotifyMode is "listen" while LISTEN is connected and "polling" otherwise.
func (r *Renewer) NotifyMode() string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.notifyMode
}

func (r *Renewer) setPassErr(err error) {
	r.mu.Lock()
	r.passErr = err
	r.mu.Unlock()
}

// Ready reports whether the process can reach the database and holds what it
// should: nil after a successful pass in which, for every sharded group, it
// holds at least one shard or was planned none. Before the first pass, and
// while passes fail, it returns why.
func (r *Renewer) Ready() error {
	r.mu.RLock()
	err, planned, passed := r.passErr, r.planned, !r.lastPass.IsZero()
	r.mu.RUnlock()
	if err != nil {
		return fmt.Errorf("last membership pass failed: %w", err)
	}
	if !passed {
		return errors.New("no membership pass has completed yet")
	}
	for _, g := range r.cfg.Groups {
		if planned[g.Name] > 0 && len(r.Shards(g)) == 0 {
			return fmt.Errorf("holds none of the %d shards of group %s planned for it", planned[g.Name], g.Name)
		}
	}
	return nil
}

func (r *Renewer) setNotifyMode(m string) {
	r.mu.Lock()
	r.notifyMode = m
	r.mu.Unlock()
}

// Detail is the renewer's section of /healthz/detail.
func (r *Renewer) Detail(context.Context) any {
	held := r.Held()
	type lease struct {
		Name      string    `json:"name"`
		Epoch     int64     `json:"epoch"`
		ExpiresAt time.Time `json:"expires_at"`
	}
	out := struct {
		Owner       string              `json:"owner"`
		NotifyMode  string              `json:"notify_mode"`
		LoopAge     string              `json:"renewal_loop_age"`
		Waiting     string              `json:"waiting_for,omitempty"`
		Ready       string              `json:"ready"`
		ClockSkew   string              `json:"clock_skew"`
		Shards      map[string]int      `json:"shards_held"`
		Singletons  []lease             `json:"singletons"`
		LiveMembers map[string][]string `json:"live_members"`
	}{Owner: r.client.Owner(), NotifyMode: r.NotifyMode(), LoopAge: r.loop.Age().Round(time.Millisecond).String(),
		Shards: map[string]int{}, LiveMembers: map[string][]string{}}
	skew, _ := r.skew.Last()
	out.ClockSkew = skew.String()
	out.Waiting, _ = r.loop.Waiting()
	out.Ready = "yes"
	if err := r.Ready(); err != nil {
		out.Ready = err.Error()
	}
	for _, g := range r.cfg.Groups {
		out.Shards[g.Name] = len(r.Shards(g))
	}
	for _, l := range held {
		if _, isShard := r.shardGroup(l.Name); !isShard {
			out.Singletons = append(out.Singletons, lease{l.Name, l.Epoch, l.ExpiresAt})
		}
	}
	r.mu.RLock()
	for g, ms := range r.lastMembers {
		for _, m := range ms {
			out.LiveMembers[g] = append(out.LiveMembers[g], m.ID)
		}
	}
	r.mu.RUnlock()
	return out
}

func (r *Renewer) shardGroup(name string) (Group, bool) {
	for _, g := range r.cfg.Groups {
		if _, ok := g.ShardOfLease(name); ok {
			return g, true
		}
	}
	return Group{}, false
}

func (r *Renewer) running(ctx context.Context) error {
	if url := r.cfg.NotifyURL; url != "" {
		lctx, cancel := context.WithCancel(ctx)
		defer cancel()
		done := make(chan struct{})
		defer func() { cancel(); <-done }()
		go func() { defer close(done); r.listen(lctx, url) }()
	}
	tick := r.clock.NewTicker(r.cfg.Timings.Tick())
	defer tick.Stop()
	r.pass(ctx, "start")
	for {
		select {
		case <-ctx.Done():
			return nil
		case reason := <-r.trigger:
			r.pass(ctx, reason)
		case <-tick.Chan():
			if reason, due := r.due(); due {
				r.pass(ctx, reason)
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
	if err := r.doPass(ctx); err != nil {
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
	r.loop.Beat()
	r.logger.Debug("membership pass", "trigger", trigger, "took", r.clock.Since(start), "held", len(r.held))
}

func (r *Renewer) doPass(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.Timings.LeaseTTL/3)
	defer cancel()
	t := r.cfg.Timings
	skew, _ := r.skew.Last()
	info := HeartbeatInfo{ProcessID: r.client.Owner(), Hostname: r.host, Version: r.cfg.Version,
		ClockSkew: skew, NotifyMode: r.NotifyMode(), LeasesHeld: len(r.Held())}

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

// apply replaces the held set with the grant; a previously held name that
// was wanted but not granted has been lost.
func (r *Renewer) apply(g Grant, want []string) {
	r.mu.Lock()
	before := len(r.held)
	added := 0
	wanted := make(map[string]bool, len(want))
	for _, n := range want {
		wanted[n] = true
	}
	next := make(map[string]Lease, len(g.Leases))
	for _, l := range g.Leases {
		if old, ok := r.held[l.Name]; !ok || old.Epoch != l.Epoch {
			added++
			if _, shard := r.shardGroup(l.Name); !shard {
				r.logger.Info("singleton lease taken", "lease", l.Name, "epoch", l.Epoch)
			}
		}
		next[l.Name] = l
	}
	var lost []string
	for name := range r.held {
		if _, ok := next[name]; !ok && wanted[name] {
			lost = append(lost, name)
		}
	}
	r.held = next
	changed := added > 0 || len(lost) > 0 || before != len(next)
	if changed {
		close(r.changed)
		r.changed = make(chan struct{})
	}
	r.mu.Unlock()
	if len(lost) > 0 {
		r.m.leasesLost.Add(float64(len(lost)))
		r.logger.Warn("leases lost: another owner holds them now", "count", len(lost), "leases", truncate(lost, 8))
	}
	if added > 0 {
		r.logger.Info("leases acquired", "count", added, "held", len(next))
	}
	r.exportHeld()
}

func (r *Renewer) forget(names ...string) {
	if len(names) == 0 {
		return
	}
	r.mu.Lock()
	for _, n := range names {
		delete(r.held, n)
	}
	close(r.changed)
	r.changed = make(chan struct{})
	r.mu.Unlock()
	r.exportHeld()
}

func (r *Renewer) exportHeld() {
	held := r.Held()
	r.m.leasesHeld.Set(float64(len(held)))
	for _, g := range r.cfg.Groups {
		r.m.shardsOwned.WithLabelValues(g.Name).Set(float64(len(r.Shards(g))))
	}
	epochs := map[string]int64{}
	for _, l := range held {
		epochs[l.Name] = l.Epoch
	}
	for _, s := range r.singletons() {
		r.m.epochs.WithLabelValues(s).Set(float64(epochs[s]))
	}
}

func truncate(s []string, n int) []string {
	sort.Strings(s)
	if len(s) > n {
		return append(s[:n:n], fmt.Sprintf("… %d more", len(s)-n))
	}
	return s
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

// listen keeps a LISTEN connection on ReleaseChannel and triggers a pass when
// a lease this process wants is released. pgxlisten reconnects after errors;
// on every (re)connect a pass runs, since notifications may have been missed.
func (r *Renewer) listen(ctx context.Context, url string) {
	l := &pgxlisten.Listener{
		Connect: func(ctx context.Context) (*pgx.Conn, error) {
			cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			return pgx.Connect(cctx, url)
		},
		LogError: func(ctx context.Context, err error) {
			r.setNotifyMode("polling")
			if ctx.Err() == nil {
				r.logger.Warn("LISTEN connection lost; polling until it is back", "err", err)
			}
		},
		ReconnectDelay: time.Second,
	}
	l.Handle(ReleaseChannel, releaseHandler{r})
	_ = l.Listen(ctx)
	r.setNotifyMode("polling")
}

type releaseHandler struct{ r *Renewer }

func (h releaseHandler) HandleNotification(_ context.Context, n *pgconn.Notification, _ *pgx.Conn) error {
	if h.r.interested(n.Payload) {
		h.r.Trigger("notify")
	}
	return nil
}

// interested reports whether a released lease is one this process may take:
// a singleton it runs or a shard of one of its groups that it does not hold.
func (r *Renewer) interested(name string) bool {
	for _, s := range r.singletons() {
		if s == name {
			return true
		}
	}
	if _, ok := r.shardGroup(name); ok {
		_, held := r.Lease(name)
		return !held
	}
	return false
}

// HandleBacklog runs on every (re)connect of the LISTEN connection.
func (h releaseHandler) HandleBacklog(context.Context, string, *pgx.Conn) error {
	h.r.setNotifyMode("listen")
	h.r.Trigger("listen-connected")
	return nil
}
