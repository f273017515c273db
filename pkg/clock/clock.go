// Package clock provides the process clocks: the real one, and a scaled one
// that benchmarks and simulators install so a run of production durations
// takes a fraction of the wall time (docs/design.md#time).
//
// Both are clockwork.Clock values (github.com/jonboulle/clockwork): code
// takes a clockwork.Clock, tests use clockwork's fake clock, and a scaled
// run gives every process the same Scale. Scaled wraps clockwork's real
// clock rather than reimplementing timers: it only converts durations.
//
// A scaled run must also scale the database clock, since every lease
// comparison uses compute_now(): InstallSQL replaces compute_now() in one
// database with the same mapping. Production migrations never depend on it.
package clock

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/jonboulle/clockwork"
)

// Scale maps wall time to simulated time: simulated = Epoch + (wall -
// Epoch) * Rate. At Epoch both clocks agree; Rate 1 is the real clock.
type Scale struct {
	// Epoch is the wall instant at which simulated and wall time agree.
	Epoch time.Time
	// Rate is how many simulated seconds pass per wall second, in [1, 100].
	Rate float64
}

// Sim is the simulated instant of wall instant t.
func (s Scale) Sim(t time.Time) time.Time {
	return s.Epoch.Add(time.Duration(float64(t.Sub(s.Epoch)) * s.Rate))
}

// MaxRate bounds Rate: beyond it, a 1 ms simulated timer would be shorter
// than the scheduler's granularity and ordering between processes breaks
// down.
const MaxRate = 100

// Validate refuses a rate outside [1, MaxRate] or a zero epoch.
func (s Scale) Validate() error {
	if math.IsNaN(s.Rate) || s.Rate < 1 || s.Rate > MaxRate {
		return fmt.Errorf("clock rate %v must be in [1, %d]", s.Rate, MaxRate)
	}
	if s.Epoch.IsZero() {
		return errors.New("clock epoch must be set")
	}
	return nil
}

// New returns the real clock when s.Rate is 0 or 1, else a scaled clock.
// It refuses an invalid scale.
func New(s Scale) (clockwork.Clock, error) {
	if s.Rate == 0 || s.Rate == 1 {
		return clockwork.NewRealClock(), nil
	}
	if err := s.Validate(); err != nil {
		return nil, err
	}
	return newScaled(s, clockwork.NewRealClock()), nil
}

// newScaled scales base (the real clock; a fake one in tests).
func newScaled(s Scale, base clockwork.Clock) *scaled { return &scaled{s: s, real: base} }

// scaled is a clockwork.Clock whose Now runs Rate times faster than its
// base (the wall clock) and whose timers fire after d/Rate of wall time. Values sent
// on timer and ticker channels are wall times (clockwork's real timers);
// read Now for the simulated time.
type scaled struct {
	s    Scale
	real clockwork.Clock
}

func (c *scaled) wall(d time.Duration) time.Duration {
	if d <= 0 {
		return d
	}
	return max(time.Duration(float64(d)/c.s.Rate), 1)
}

func (c *scaled) Now() time.Time {
	return c.s.Sim(c.real.Now())
}
func (c *scaled) Since(t time.Time) time.Duration        { return c.Now().Sub(t) }
func (c *scaled) Until(t time.Time) time.Duration        { return t.Sub(c.Now()) }
func (c *scaled) After(d time.Duration) <-chan time.Time { return c.real.After(c.wall(d)) }
func (c *scaled) Sleep(d time.Duration)                  { c.real.Sleep(c.wall(d)) }
func (c *scaled) NewTicker(d time.Duration) clockwork.Ticker {
	return scaledTicker{c.real.NewTicker(c.wall(d)), c}
}
func (c *scaled) NewTimer(d time.Duration) clockwork.Timer {
	return scaledTimer{c.real.NewTimer(c.wall(d)), c}
}
func (c *scaled) AfterFunc(d time.Duration, f func()) clockwork.Timer {
	return scaledTimer{c.real.AfterFunc(c.wall(d), f), c}
}

type scaledTimer struct {
	clockwork.Timer
	c *scaled
}

func (t scaledTimer) Reset(d time.Duration) bool { return t.Timer.Reset(t.c.wall(d)) }

type scaledTicker struct {
	clockwork.Ticker
	c *scaled
}

func (t scaledTicker) Reset(d time.Duration) { t.Ticker.Reset(t.c.wall(d)) }
