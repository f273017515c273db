package agent

import (
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jonboulle/clockwork"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/health"
)

// Fence is the agent's self-fence: it says whether the agent may answer
// DHCP and iPXE now. The agent answers only while
//
//   - its session is open (a closed stream fences at once),
//   - its latest spec grants it site_boot.active for this site at an epoch
//     no older than any epoch it has seen, and
//   - less than SelfFence has passed since the grant: since the grant's
//     site_boot.granted_at (the database time of the renewal that
//     published it, so a grant delivered late buys nothing) and since it
//     was received.
//
// The lease renewed at granted_at lives until granted_at + TTL, and no other
// agent is promoted before granted_at + promote-after, so with
// SelfFence < TTL <= promote-after two agents never answer at once, given
// that this host's clock is within TTL - SelfFence (5 s by default) of the
// database's.
type Fence struct {
	selfFence time.Duration
	siteID    string
	clock     clockwork.Clock
	log       *slog.Logger
	connected func() bool

	mu        sync.Mutex
	active    bool
	epoch     uint64 // epoch of the current grant
	seenEpoch uint64 // highest epoch seen in any spec
	deadline  time.Time
	granted   bool // a grant was ever held (for the fenced role)
	grants    int64
	refused   string
}

// NewFence returns a fence for siteID; connected reports whether the
// session is open.
func NewFence(selfFence time.Duration, siteID string, clock clockwork.Clock, log *slog.Logger, connected func() bool) *Fence {
	if clock == nil {
		clock = clockwork.NewRealClock()
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if connected == nil {
		connected = func() bool { return true }
	}
	return &Fence{selfFence: selfFence, siteID: siteID, clock: clock, log: log, connected: connected}
}

// Apply takes a spec from Welcome or NodeSpecUpdate.
func (f *Fence) Apply(spec *nodev1.NodeSpec) {
	now := f.clock.Now()
	sb := spec.GetSiteBoot()
	f.mu.Lock()
	defer f.mu.Unlock()
	if sb == nil || sb.GetSiteId() != f.siteID {
		f.standbyLocked("spec carries no boot grant for this site")
		return
	}
	if sb.GetEpoch() < f.seenEpoch {
		f.log.Warn("ignoring a spec older than one already seen", "epoch", sb.GetEpoch(), "seen_epoch", f.seenEpoch)
		return
	}
	f.seenEpoch = sb.GetEpoch()
	if !sb.GetActive() {
		f.standbyLocked("")
		return
	}
	if sb.GetLeaseTtl() == nil || sb.GetPromoteAfter() == nil || sb.GetGrantedAt() == nil {
		f.refuseLocked("grant lacks site_boot.lease_ttl, site_boot.promote_after or site_boot.granted_at")
		return
	}
	ttlD, promoteD, grantedAt := sb.GetLeaseTtl().AsDuration(), sb.GetPromoteAfter().AsDuration(), sb.GetGrantedAt().AsTime()
	if err := CheckOrdering(f.selfFence, ttlD, promoteD); err != nil {
		f.refuseLocked(fmt.Sprintf("the control plane's boot lease timings break the ordering: %v", err))
		return
	}
	remaining := min(f.selfFence, grantedAt.Add(f.selfFence).Sub(now))
	if remaining <= 0 {
		f.refuseLocked(fmt.Sprintf("grant of epoch %d from %s is already older than the self-fence %s (late delivery or clock skew)",
			sb.GetEpoch(), grantedAt.Format(time.RFC3339Nano), f.selfFence))
		return
	}
	if !f.active || f.epoch != sb.GetEpoch() {
		f.log.Info("boot grant: answering DHCP and iPXE", "epoch", sb.GetEpoch(), "valid_for", remaining.Round(time.Millisecond))
	}
	f.active, f.epoch, f.granted, f.refused = true, sb.GetEpoch(), true, ""
	f.deadline = now.Add(remaining)
	f.grants++
}

func (f *Fence) standbyLocked(why string) {
	if f.active {
		f.log.Info("boot grant withdrawn: standby", "epoch", f.epoch, "reason", why)
	}
	f.active, f.granted, f.refused = false, false, ""
}

func (f *Fence) refuseLocked(why string) {
	if f.refused != why {
		f.log.Error("boot grant refused: standby", "reason", why)
	}
	f.active, f.refused = false, why
}

// Answering reports whether the agent may answer now, and its epoch.
func (f *Fence) Answering() (uint64, bool) {
	if !f.connected() {
		return 0, false
	}
	now := f.clock.Now()
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.active || !now.Before(f.deadline) {
		return 0, false
	}
	return f.epoch, true
}

// Role is active (answering), fenced (a grant ran out or the session
// closed while granted) or standby.
func (f *Fence) Role() health.Role {
	if _, ok := f.Answering(); ok {
		return health.RoleActive
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.granted {
		return health.RoleFenced
	}
	return health.RoleStandby
}

// Detail is the fence's state for /healthz/detail.
func (f *Fence) Detail() map[string]any {
	epoch, answering := f.Answering()
	f.mu.Lock()
	defer f.mu.Unlock()
	d := map[string]any{"answering": answering, "epoch": epoch, "seen_epoch": f.seenEpoch, "grants": f.grants,
		"self_fence": f.selfFence.String(), "refused": f.refused}
	if f.active {
		d["valid_for"] = f.deadline.Sub(f.clock.Now()).Round(time.Millisecond).String()
	}
	return d
}

// CheckOrdering is docs/design.md#timings's self-fence < TTL <= promotion.
func CheckOrdering(selfFence, ttl, promote time.Duration) error {
	if selfFence <= 0 {
		return fmt.Errorf("--boot.self-fence %s must be positive", selfFence)
	}
	if selfFence >= ttl {
		return fmt.Errorf("--boot.self-fence %s must be less than the boot lease TTL %s (self-fence < TTL)", selfFence, ttl)
	}
	if ttl > promote {
		return fmt.Errorf("the boot lease TTL %s must be <= the promotion delay %s (TTL <= promotion)", ttl, promote)
	}
	return nil
}
