package coord

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/pkg/pgdb"
)

// KeeperConfig configures a Keeper.
type KeeperConfig struct {
	// Name is the lease kept (e.g. gateway:<id>).
	Name string
	// TTL is the lease's duration in the database.
	TTL time.Duration
	// Renew is how often the lease is renewed, and how often a take is
	// retried while it is not held.
	Renew time.Duration
	// Trust is how long after a successful renewal was sent the holder
	// trusts the lease (0: TTL/2). It must be <= TTL; past it the keeper
	// drops the lease and calls OnLost, before the database would let anyone
	// else take it.
	Trust time.Duration
	// OnAcquired is called, on the keeper's goroutine, each time a new
	// holding starts (a new epoch).
	OnAcquired func(Lease)
	// OnLost is called once per holding when the keeper stops trusting it:
	// its trust window passed without a renewal (a database outage, a
	// pause), a renewal found it held by another owner or at another epoch
	// or the database on a new timeline (a failover to a standby), or a
	// fenced transaction failed its fence. It may be called on any
	// goroutine that runs RunFenced; it must not block on the keeper.
	OnLost func(l Lease, reason string)
	// ObserveRenewal, if set, gets the round trip of every renewal or take.
	ObserveRenewal func(time.Duration)
}

// Validate checks the timings, naming the field at fault.
func (c KeeperConfig) Validate() error {
	if err := ValidateName(c.Name); err != nil {
		return fmt.Errorf("keeper name: %w", err)
	}
	if err := ValidateTTL(c.TTL); err != nil {
		return fmt.Errorf("keeper %s TTL: %w", c.Name, err)
	}
	if c.Trust < 0 || c.Trust > c.TTL {
		return fmt.Errorf("keeper %s: trust %s must be between 0 and the TTL %s", c.Name, c.Trust, c.TTL)
	}
	if c.Renew <= 0 || c.Renew >= c.trust() {
		return fmt.Errorf("keeper %s: renew interval %s must be > 0 and below the trust window %s", c.Name, c.Renew, c.trust())
	}
	return nil
}

func (c KeeperConfig) trust() time.Duration {
	if c.Trust == 0 {
		return c.TTL / 2
	}
	return c.Trust
}

// Keeper keeps one lease for one owner for the life of a process: it takes
// the lease (each holding at a new epoch, TakeFresh's rule, through the
// client's guarded grant of restore.go), renews it every Renew,
// trusts it until the last renewal's send time plus Trust on the process's
// clock, and when trust ends calls OnLost and goes back to taking it. It
// never gives up because the database is away: it retries until it holds
// the lease again, so an outage of any length ends without a restart.
//
// Writes made on behalf of the lease go through RunFenced, which refuses
// locally once trust has passed and fences on owner and epoch in the
// database.
type Keeper struct {
	cfg    KeeperConfig
	client *Client
	clock  clockwork.Clock
	log    *slog.Logger

	mu         sync.Mutex
	lease      Lease
	held       bool
	lastSent   time.Time // process clock when the last granted statement was sent
	trustUntil time.Time
	lastErr    error // the last take or renewal error (nil after a success)
	acquired   chan struct{}
}

// NewKeeper returns a keeper of cfg.Name for client's owner. Start it with
// Run.
func NewKeeper(client *Client, cfg KeeperConfig, logger *slog.Logger) (*Keeper, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	} else {
		client.adoptLogger(logger)
	}
	return &Keeper{cfg: cfg, client: client, clock: client.clock, log: logger, acquired: make(chan struct{})}, nil
}

// Name is the kept lease's name.
func (k *Keeper) Name() string { return k.cfg.Name }

// Current returns the lease while it is held and trusted.
func (k *Keeper) Current() (Lease, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !k.held || !k.clock.Now().Before(k.trustUntil) {
		return k.lease, false
	}
	return k.lease, true
}

// Err is the last error of a take or renewal, nil once one succeeded.
func (k *Keeper) Err() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.lastErr
}

// Acquired returns a channel closed at the next start of a holding.
func (k *Keeper) Acquired() <-chan struct{} {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.acquired
}

// Run keeps the lease until ctx ends. It does not release the lease on
// return: call Release for a graceful handover.
func (k *Keeper) Run(ctx context.Context) {
	tick := min(max(k.cfg.Renew/5, 10*time.Millisecond), time.Second)
	t := k.clock.NewTicker(tick)
	defer t.Stop()
	var nextTake time.Time
	for {
		k.step(ctx, &nextTake)
		select {
		case <-ctx.Done():
			return
		case <-t.Chan():
		}
	}
}

func (k *Keeper) step(ctx context.Context, nextTake *time.Time) {
	now := k.clock.Now()
	k.mu.Lock()
	held, lease, trustUntil, lastSent := k.held, k.lease, k.trustUntil, k.lastSent
	k.mu.Unlock()
	switch {
	case held && !now.Before(trustUntil):
		k.lose(lease, fmt.Sprintf("no successful renewal of %s for %s", k.cfg.Name, k.cfg.trust()))
	case held && !now.Before(lastSent.Add(k.cfg.Renew)):
		k.renew(ctx, lease)
	case !held && !now.Before(*nextTake):
		*nextTake = now.Add(k.cfg.Renew)
		k.take(ctx)
	}
}

func (k *Keeper) renew(ctx context.Context, l Lease) {
	rctx, cancel := context.WithTimeout(ctx, k.cfg.trust())
	defer cancel()
	sent := k.clock.Now()
	renewed, ok, err := Renew(rctx, k.client.db, l, k.cfg.TTL)
	k.observe(sent)
	switch {
	case err != nil:
		k.setErr(err)
		if ctx.Err() == nil {
			k.log.Warn("lease renewal failed; still trusted until its window ends", "lease", k.cfg.Name, "epoch", l.Epoch, "err", err)
		}
	case !ok:
		k.lose(l, fmt.Sprintf("%s is held by another owner or at another epoch", k.cfg.Name))
	case renewed.Floor != l.Floor:
		// A promoted standby, or a restore detected (restore.go): what this
		// holding wrote may be gone, and what the holder remembers outside
		// the database (a gateway's sessions) may no longer match. End the
		// holding; the next one starts at an epoch above the new floor.
		k.lose(l, fmt.Sprintf("the epoch floor changed: the database failed over to a new timeline or went back in time (epoch floor %d, was %d)", renewed.Floor, l.Floor))
	default:
		k.grant(renewed, sent, false)
	}
}

func (k *Keeper) take(ctx context.Context) {
	rctx, cancel := context.WithTimeout(ctx, k.cfg.trust())
	defer cancel()
	sent := k.clock.Now()
	l, ok, err := k.client.takeKept(rctx, k.cfg.Name, k.cfg.TTL)
	k.observe(sent)
	switch {
	case err != nil:
		k.setErr(err)
		if ctx.Err() == nil {
			k.log.Warn("lease take failed; retrying", "lease", k.cfg.Name, "retry_in", k.cfg.Renew, "err", err)
		}
	case !ok:
		k.setErr(nil)
		k.log.Warn("lease held by another owner; waiting for it to expire", "lease", k.cfg.Name)
	default:
		k.grant(l, sent, true)
	}
}

// grant records a take or renewal sent at sent. A grant that comes back
// after its own trust window (the statement straddled a pause) is dropped.
func (k *Keeper) grant(l Lease, sent time.Time, fresh bool) {
	trustUntil := sent.Add(k.cfg.trust())
	if !k.clock.Now().Before(trustUntil) {
		if fresh {
			k.log.Warn("lease take returned after its trust window; taking it again", "lease", k.cfg.Name)
		} else {
			k.lose(l, fmt.Sprintf("renewal of %s returned after its trust window", k.cfg.Name))
		}
		return
	}
	l.ValidUntil = trustUntil
	k.mu.Lock()
	if !fresh && (!k.held || k.lease.Epoch != l.Epoch) {
		// The holding was dropped (Drop, a fence that found it lost, or
		// Release) while its renewal was in flight: it stays dropped, and
		// the next take starts a new holding at a new epoch. Granting the
		// renewal would trust again what the holder already gave up.
		k.mu.Unlock()
		return
	}
	k.lease, k.held, k.lastSent, k.trustUntil, k.lastErr = l, true, sent, trustUntil, nil
	var started chan struct{}
	if fresh {
		started = k.acquired
		k.acquired = make(chan struct{})
	}
	k.mu.Unlock()
	if fresh {
		close(started)
		k.log.Info("lease taken", "lease", k.cfg.Name, "epoch", l.Epoch)
		if k.cfg.OnAcquired != nil {
			k.cfg.OnAcquired(l)
		}
	}
}

// lose drops the holding at l's epoch, once, and calls OnLost.
func (k *Keeper) lose(l Lease, reason string) {
	k.mu.Lock()
	if !k.held || k.lease.Epoch != l.Epoch {
		k.mu.Unlock()
		return
	}
	k.held = false
	k.mu.Unlock()
	k.log.Warn("lease no longer trusted", "lease", k.cfg.Name, "epoch", l.Epoch, "reason", reason)
	if k.cfg.OnLost != nil {
		k.cfg.OnLost(l, reason)
	}
}

// Drop stops trusting the current holding without touching the database
// (a self-fence decided outside the keeper) and calls OnLost. The keeper
// takes the lease again, at a new epoch, on its next attempt.
func (k *Keeper) Drop(reason string) {
	k.mu.Lock()
	l, held := k.lease, k.held
	k.mu.Unlock()
	if held {
		k.lose(l, reason)
	}
}

func (k *Keeper) setErr(err error) {
	k.mu.Lock()
	k.lastErr = err
	k.mu.Unlock()
}

func (k *Keeper) observe(sent time.Time) {
	if k.cfg.ObserveRenewal != nil {
		k.cfg.ObserveRenewal(k.clock.Since(sent))
	}
}

// ErrNotHeld is returned by RunFenced while the keeper holds no trusted lease.
var ErrNotHeld = errors.New("lease not held")

// RunFenced runs fn in a transaction on db fenced on the kept lease (see
// RunFenced). A fence that finds the lease lost drops the holding (OnLost)
// before the error is returned.
func (k *Keeper) RunFenced(ctx context.Context, db pgdb.Beginner, fn func(ctx context.Context, tx pgx.Tx) error) error {
	l, ok := k.Current()
	if !ok {
		return fmt.Errorf("%s: %w", k.cfg.Name, ErrNotHeld)
	}
	err := RunFenced(ctx, db, l, FenceOptions{Now: k.clock.Now}, fn)
	if errors.Is(err, ErrLeaseLost) {
		k.lose(l, "a fenced transaction found the lease lost")
	}
	return err
}

// Release gives the lease up in the database if it is held (a graceful
// stop), so a successor need not wait for the TTL.
func (k *Keeper) Release(ctx context.Context) error {
	k.mu.Lock()
	held := k.held
	k.held = false
	k.mu.Unlock()
	if !held {
		return nil
	}
	_, err := k.client.Release(ctx, k.cfg.Name)
	return err
}
