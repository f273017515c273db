package health

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"
)

// Loop tracks the progress of one of a process's loops for /livez: a loop
// that has not beaten for its stall limit makes the process not live, so its
// supervisor restarts it.
//
// A loop that cannot make progress because the database does not answer is
// waiting, not stalled: it calls Wait on every attempt, which counts as
// progress (a restart cannot fix a database outage), and Waiting reports the
// reason for readiness and /healthz/detail until the next Beat.
type Loop struct {
	name    string
	limit   time.Duration
	now     func() time.Time
	last    atomic.Int64 // unix nanos of the last beat or wait
	waiting atomic.Pointer[string]
}

// NewLoop returns a loop watchdog that counts as stalled after limit without
// a Beat or Wait. now is the clock (nil: time.Now). It starts as just beaten.
func NewLoop(name string, limit time.Duration, now func() time.Time) *Loop {
	if now == nil {
		now = time.Now
	}
	l := &Loop{name: name, limit: limit, now: now}
	l.Beat()
	return l
}

// Beat records progress and ends a wait.
func (l *Loop) Beat() {
	l.last.Store(l.now().UnixNano())
	l.waiting.Store(nil)
}

// Wait records an attempt that could not progress because a dependency did
// not answer: the loop is alive, and Waiting returns reason until the next
// Beat.
func (l *Loop) Wait(reason string) {
	l.last.Store(l.now().UnixNano())
	l.waiting.Store(&reason)
}

// Waiting returns the reason of the last Wait when no Beat followed it.
func (l *Loop) Waiting() (string, bool) {
	if r := l.waiting.Load(); r != nil {
		return *r, true
	}
	return "", false
}

// Age is the time since the last beat or wait.
func (l *Loop) Age() time.Duration { return l.now().Sub(time.Unix(0, l.last.Load())) }

// Stalled reports whether the loop is past its limit.
func (l *Loop) Stalled() bool { return l.Age() > l.limit }

// Check is the loop's liveness check.
func (l *Loop) Check(context.Context) error {
	if age := l.Age(); age > l.limit {
		return fmt.Errorf("%s loop stalled: last progress %s ago (limit %s)", l.name, age.Round(time.Millisecond), l.limit)
	}
	return nil
}

// Name is the loop's name.
func (l *Loop) Name() string { return l.name }
