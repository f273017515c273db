package daemon

import (
	"math/rand/v2"
	"time"
)

// Backoff is full-jitter exponential back-off: each delay is uniform in
// [0, b], b starting at Base and doubling up to Max. Reset after a stable
// session starts again from Base.
type Backoff struct {
	// Base is the first bound (default 1 s); Max the largest (default 60 s).
	Base, Max time.Duration
	// Rand returns a uniform float in [0, 1) (default math/rand/v2).
	Rand func() float64

	bound time.Duration
}

// Next returns the next delay and doubles the bound.
func (b *Backoff) Next() time.Duration {
	if b.Base <= 0 {
		b.Base = time.Second
	}
	if b.Max < b.Base {
		b.Max = max(b.Base, 60*time.Second)
	}
	if b.Rand == nil {
		b.Rand = rand.Float64
	}
	if b.bound == 0 {
		b.bound = b.Base
	}
	d := time.Duration(b.Rand() * float64(b.bound))
	b.bound = min(2*b.bound, b.Max)
	return d
}

// Bound is the bound the next delay is drawn under.
func (b *Backoff) Bound() time.Duration {
	if b.bound == 0 {
		return b.Base
	}
	return b.bound
}

// Reset starts again from Base.
func (b *Backoff) Reset() { b.bound = 0 }
