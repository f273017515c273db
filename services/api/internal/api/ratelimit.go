package api

import (
	"fmt"
	"math"
	"net"
	"strconv"
	"sync"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/time/rate"
)

// maxLimiterKeys bounds the limiter's map: callers by token are as many as
// the keyring holds, but enrollment callers are keyed by address, which a
// scan of many sources could grow without end; past the bound the map
// starts afresh (every caller gets a full bucket once more).
const maxLimiterKeys = 10000

// callLimiter bounds the calls of each caller of one api replica: a token
// bucket per bearer token (its audit id), and per source address for the
// enrollment calls that carry no bearer token. One token's flood then
// costs its owner, not every other caller.
type callLimiter struct {
	limit rate.Limit
	burst int

	mu sync.Mutex
	m  map[string]*rate.Limiter
}

// newCallLimiter returns a limiter of perSecond calls with a burst, or nil
// (no limit) when perSecond is 0.
func newCallLimiter(perSecond float64, burst int) *callLimiter {
	if perSecond <= 0 {
		return nil
	}
	return &callLimiter{limit: rate.Limit(perSecond), burst: burst, m: map[string]*rate.Limiter{}}
}

// allow takes a call from key's bucket, or says how long until one is
// there. A nil limiter allows everything.
func (l *callLimiter) allow(key string) (bool, time.Duration) {
	if l == nil {
		return true, 0
	}
	l.mu.Lock()
	lim, ok := l.m[key]
	if !ok {
		if len(l.m) >= maxLimiterKeys {
			clear(l.m)
		}
		lim = rate.NewLimiter(l.limit, l.burst)
		l.m[key] = lim
	}
	l.mu.Unlock()
	r := lim.Reserve()
	if d := r.Delay(); d > 0 {
		r.Cancel() // not taken: the caller is refused, not queued
		return false, d
	}
	return true, 0
}

// refusal is the RESOURCE_EXHAUSTED a refused call gets, with the wait in
// a Retry-After header (whole seconds, at least one).
func (l *callLimiter) refusal(who string, wait time.Duration) *connect.Error {
	err := connect.NewError(connect.CodeResourceExhausted, fmt.Errorf(
		"rate limit: %s made more than %g calls/s (burst %d, --api.rate-limit / --api.rate-burst); retry in %s",
		who, float64(l.limit), l.burst, wait.Round(time.Millisecond)))
	err.Meta().Set("Retry-After", strconv.Itoa(int(math.Max(1, math.Ceil(wait.Seconds())))))
	return err
}

// peerHost is the host of a request's remote address.
func peerHost(remote string) string {
	if h, _, err := net.SplitHostPort(remote); err == nil {
		return h
	}
	return remote
}
