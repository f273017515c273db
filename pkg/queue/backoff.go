package queue

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"time"
)

// Default back-off of a failed run.
const (
	DefaultBackoffBase = time.Second
	DefaultBackoffMax  = 5 * time.Minute
)

// Backoff spaces the retries of a failing key: exponential with full jitter,
// a delay drawn uniformly from [0, min(Max, Base·2^(attempts-1))]. Full
// jitter spreads the retries of many keys that failed together (a database
// blip) instead of bunching them at the same instants.
//
// It is a pure function of the attempt count rather than a retry loop (as
// dskit's backoff.Backoff is): the attempt count lives in the work_queue row,
// the wait happens in the database as a due_at, and any worker may run the
// retry.
type Backoff struct {
	// Base is the cap of the first retry's delay (0: DefaultBackoffBase).
	Base time.Duration
	// Max caps every delay (0: DefaultBackoffMax).
	Max time.Duration
	// Rand returns a number in [0, 1) (nil: math/rand/v2's Float64). It
	// must be safe for concurrent use when the Backoff is shared.
	Rand func() float64
}

// RegisterFlags registers the back-off flags under prefix, e.g.
// "reconcile." gives -reconcile.backoff-base and -reconcile.backoff-max.
func (b *Backoff) RegisterFlags(prefix string, f *flag.FlagSet) {
	f.DurationVar(&b.Base, prefix+"backoff-base", DefaultBackoffBase, "Cap of the first retry delay of a failed reconcile (full jitter below it).")
	f.DurationVar(&b.Max, prefix+"backoff-max", DefaultBackoffMax, "Cap of every retry delay of a failed reconcile.")
}

// Validate refuses a negative base or a max below the base.
func (b Backoff) Validate() error {
	base, maxd := b.limits()
	if base < 0 || maxd < 0 {
		return fmt.Errorf("back-off: base %s and max %s must not be negative", b.Base, b.Max)
	}
	if maxd < base {
		return fmt.Errorf("back-off: max %s must be at least base %s", maxd, base)
	}
	return nil
}

func (b Backoff) limits() (base, maxd time.Duration) {
	base, maxd = b.Base, b.Max
	if base == 0 {
		base = DefaultBackoffBase
	}
	if maxd == 0 {
		maxd = DefaultBackoffMax
	}
	return base, maxd
}

// Cap is the largest delay after the given number of attempts (1 for the
// first failed run): min(Max, Base·2^(attempts-1)).
func (b Backoff) Cap(attempts int) time.Duration {
	base, maxd := b.limits()
	if base <= 0 || maxd <= 0 {
		return 0
	}
	if attempts < 1 {
		attempts = 1
	}
	c := base
	for i := 1; i < attempts && c < maxd; i++ {
		if c > maxd/2 {
			return maxd // doubling would pass max (or overflow)
		}
		c *= 2
	}
	return min(c, maxd)
}

// Delay draws the wait before the next run after attempts failed runs.
func (b Backoff) Delay(attempts int) time.Duration {
	c := b.Cap(attempts)
	r := rand.Float64
	if b.Rand != nil {
		r = b.Rand
	}
	d := time.Duration(r() * float64(c))
	return max(0, min(d, c)).Truncate(time.Millisecond)
}
