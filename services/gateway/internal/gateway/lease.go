package gateway

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jonboulle/clockwork"

	"github.com/leasehold/leasehold/pkg/coord"
)

// leaseKeeper holds gateway:<id>. The gateway trusts the lease only until
// the last successful renewal was sent plus half the TTL: past that, or as
// soon as a renewal shows another owner, it fences itself. Every routing and
// liveness transaction runs through run, which fences on the lease in the
// database and refuses locally once the trust window has passed, so a
// process resumed from a long pause writes nothing before it fences.
type leaseKeeper struct {
	client *coord.Client
	name   string
	ttl    time.Duration
	renew  time.Duration
	clock  clockwork.Clock
	m      *metrics

	mu         sync.Mutex
	lease      coord.Lease
	held       bool
	lastRenew  time.Time // process clock when the last granted renewal was sent
	trustUntil time.Time
}

func (k *leaseKeeper) current() (coord.Lease, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.lease, k.held
}

// acquire takes or renews the lease once. granted is false when another
// owner holds it live.
func (k *leaseKeeper) acquire(ctx context.Context) (granted bool, err error) {
	sent := k.clock.Now()
	l, ok, err := k.client.Acquire(ctx, k.name, k.ttl)
	k.m.renewLatency.Observe(k.clock.Since(sent).Seconds())
	if err != nil || !ok {
		return false, err
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.held && l.Epoch != k.lease.Epoch {
		// The row changed owner and came back to us: what we held is gone.
		return false, nil
	}
	// coord sets ValidUntil = sent + TTL; the gateway trusts it for half.
	k.lastRenew = sent
	k.trustUntil = sent.Add(k.ttl / 2)
	l.ValidUntil = k.trustUntil
	k.lease, k.held = l, true
	return true, nil
}

// forget drops the lease without touching the database (self-fence).
func (k *leaseKeeper) forget() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.held = false
}

// expired reports whether the trust window has passed.
func (k *leaseKeeper) expired() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.held && !k.clock.Now().Before(k.trustUntil)
}

// errNotHeld is returned by run when the gateway holds no lease.
var errNotHeld = errors.New("gateway lease not held")

// run runs fn in a transaction fenced on the lease.
func (k *leaseKeeper) run(ctx context.Context, db coordBeginner, fn func(ctx context.Context, tx pgx.Tx) error) error {
	l, ok := k.current()
	if !ok {
		return errNotHeld
	}
	err := coord.RunFenced(ctx, db, l, coord.FenceOptions{Now: k.clock.Now}, fn)
	if errors.Is(err, coord.ErrLeaseLost) {
		k.m.fenceFailures.Inc()
	}
	if err != nil {
		return fmt.Errorf("fenced on %s: %w", k.name, err)
	}
	return nil
}

type coordBeginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}
