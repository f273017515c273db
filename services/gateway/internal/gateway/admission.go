package gateway

// Admission: what a dial must pass before the gateway does any work for it
// beyond reading its Hello. The stream limit and the serving state are
// checked as the stream opens; the handshake token bucket and the cap on
// concurrent Hello transactions once the Hello has passed its free checks
// and authentication (hello.go), so only authenticated nodes spend them. A
// refused dial gets Pushback{retry_after, reason}.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// admitStream refuses a stream the gateway will not serve: one that
// arrives while it is not serving, or the n-th open stream past
// MaxStreams.
func (g *Gateway) admitStream(stream *connect.BidiStream[nodev1.ConnectRequest, nodev1.ConnectResponse], n int64) error {
	switch g.state.Load() {
	case stateServing:
	case stateDraining:
		return g.pushback(stream, "draining", time.Second+rand.N(4*time.Second), connect.CodeUnavailable)
	default:
		// Starting, or fenced while the database is away: it serves again
		// as soon as it holds its lease, so the node is told to come back
		// in a second or three rather than left to its back-off, which an
		// outage would otherwise grow towards a minute. The pushback costs
		// no database work; the jitter and the admission bucket spread the
		// fleet's return.
		return g.pushback(stream, "not-serving", notServingRetryAfter(), connect.CodeUnavailable)
	}
	if n > int64(g.cfg.MaxStreams) {
		return g.pushback(stream, "max-streams", 5*time.Second+rand.N(5*time.Second), connect.CodeResourceExhausted)
	}
	return nil
}

// admitHello takes a token of the handshake bucket, a place among the
// MaxPendingHellos Hellos admitted at once, and then waits (at most
// helloSlotWait) for one of the helloSlots that may run their transaction,
// for an authenticated Hello; or it refuses the dial with a pushback. A
// nil error must be followed by helloDone.
func (g *Gateway) admitHello(ctx context.Context, stream *connect.BidiStream[nodev1.ConnectRequest, nodev1.ConnectResponse]) error {
	if !g.limiter.AllowN(g.clock.Now(), 1) {
		return g.pushback(stream, "hello-rate", g.rateRetryAfter(), connect.CodeResourceExhausted)
	}
	busy := func() error {
		return g.pushback(stream, "max-pending-hellos", 500*time.Millisecond+rand.N(500*time.Millisecond), connect.CodeResourceExhausted)
	}
	if g.pending.Add(1) > int64(g.cfg.MaxPendingHellos) {
		g.pending.Add(-1)
		return busy()
	}
	wctx, cancel := context.WithTimeout(ctx, helloSlotWait)
	defer cancel()
	if err := g.helloRun.Acquire(wctx, 1); err != nil {
		g.pending.Add(-1)
		return busy()
	}
	return nil
}

// helloSlotWait bounds how long an admitted Hello waits for a slot to run
// its transaction: a burst is queued, a database that stalls every slot
// pushes the dials back.
const helloSlotWait = 2 * time.Second

// helloSlotsFor is how many Hello transactions may run at once with a pool
// of poolMax connections: MaxPendingHellos, but at most half the pool. A
// Hello holds a connection for its whole transaction, which waits on the
// row locks of the commands it replays; with more of them than the pool
// has connections, a reconnect wave would leave the group commit, dispatch
// and the liveness write no connection, heartbeats would go unanswered,
// and more nodes would redial (the unpaced throughput bench's collapse).
func helloSlotsFor(maxPending int, poolMax int32) int64 {
	return int64(max(1, min(maxPending, int(poolMax)/2)))
}

// helloDone frees the Hello transaction slot admitHello took.
func (g *Gateway) helloDone() {
	g.helloRun.Release(1)
	g.pending.Add(-1)
}

// notServingRetryAfter is the retry delay a starting or fenced gateway
// gives: 1 to 3 s, so a fleet is back within seconds of the gateway
// serving again, spread over two seconds.
func notServingRetryAfter() time.Duration { return time.Second + rand.N(2*time.Second) }

// pushback refuses a dial: it sends Pushback{retry_after} and closes the
// stream with code.
func (g *Gateway) pushback(stream *connect.BidiStream[nodev1.ConnectRequest, nodev1.ConnectResponse], reason string, retryAfter time.Duration, code connect.Code) error {
	return g.refuse(stream, reason, retryAfter, code, "admission refused ("+reason+")")
}

// refuse sends Pushback{retry_after, reason} and closes the stream with
// code and msg, which the retry-after is appended to.
func (g *Gateway) refuse(stream *connect.BidiStream[nodev1.ConnectRequest, nodev1.ConnectResponse], reason string, retryAfter time.Duration, code connect.Code, msg string) error {
	g.m.hellos.WithLabelValues("pushback").Inc()
	g.m.pushbacks.WithLabelValues(reason).Inc()
	_ = stream.Send(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Pushback{Pushback: &nodev1.Pushback{
		RetryAfter: durationpb.New(retryAfter), Reason: reason,
	}}})
	return connect.NewError(code, fmt.Errorf("%s: retry after %s", msg, retryAfter.Round(time.Millisecond)))
}

// rateRetryAfter hands each dial refused by the token bucket its own slot
// in a virtual queue drained at the bucket's rate, so a herd comes back
// spread over the time the bucket needs to admit it.
func (g *Gateway) rateRetryAfter() time.Duration {
	now := g.clock.Now()
	g.slotMu.Lock()
	defer g.slotMu.Unlock()
	if g.nextSlot.Before(now) {
		g.nextSlot = now
	}
	g.nextSlot = g.nextSlot.Add(time.Duration(float64(time.Second) / g.cfg.HelloRate))
	return min(g.nextSlot.Sub(now), time.Minute)
}
