package gateway

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// How far behind its work the gateway is, published for the api's
// admission (docs/gateway.md, "Overload").
//
// The lag is what a command waits for this gateway rather than for its node
// or its caller: the mean wait, in the last second, of the commands
// dispatched while their node's window had room (measured from the later
// of the command's creation and the moment the node's window last opened),
// plus how long the oldest result in the queue has waited for the group
// commit. A node offline, a node working through its own long queue or a
// window full of long commands adds nothing to it; a gateway (or a
// database) that cannot keep up with what is created adds to it every
// second.

// Defaults of --gateway.overload-lag and --gateway.overload-hold.
const (
	DefaultOverloadLag  = time.Second
	DefaultOverloadHold = 3 * time.Second
)

const (
	// loadTick is how often the lag is measured and the detector fed.
	loadTick = time.Second
	// loadRefresh is how often the row is written when nothing changed,
	// so readers see the lag of a gateway that is not overloaded too.
	loadRefresh = 15 * time.Second
	// overloadRearm is how soon after leaving overload the gateway
	// reports it again without a new hold: an overload that goes on
	// refuses in a sawtooth of a second, not of a hold.
	overloadRearm = 30 * time.Second
)

// publishLoadSQL records the gateway's lag and whether it reports
// overload, fenced on the gateway lease; readers trust the row only while
// that lease is live.
const publishLoadSQL = `
INSERT INTO gateway_load (gateway_id, lease_epoch, lag_ms, overloaded) VALUES ($1, $2, $3, $4)
ON CONFLICT (gateway_id) DO UPDATE SET lease_epoch = excluded.lease_epoch, lag_ms = excluded.lag_ms,
  overloaded = excluded.overloaded, updated_at = compute_now()`

// dispatchWaits sums the dispatch waits of one tick.
type dispatchWaits struct {
	mu  sync.Mutex
	sum time.Duration
	n   int
}

// add records one command's wait.
func (w *dispatchWaits) add(d time.Duration) {
	w.mu.Lock()
	w.sum += d
	w.n++
	w.mu.Unlock()
}

// take returns the mean wait since the last take (0 when none) and
// starts over.
func (w *dispatchWaits) take() time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.n == 0 {
		return 0
	}
	mean := w.sum / time.Duration(w.n)
	w.sum, w.n = 0, 0
	return mean
}

// waitedForGateway is the part of a command's wait (latency: creation to
// dispatch, on the database clock) that its node's window had room for:
// no longer than since the window last opened. Two durations, each on its
// own clock, so the gateway's skew against the database does not enter.
func waitedForGateway(latency time.Duration, s *session, now time.Time) time.Duration {
	sinceRoom := now.Sub(time.Unix(0, s.roomAt.Load()))
	return max(0, min(latency, sinceRoom))
}

// overloadDetector turns a lag sampled every tick into the overload the
// gateway reports: on once the lag stays past lag for hold (at once when
// it left overload less than overloadRearm ago), off once the lag falls
// below half of lag, so the api's refusals drain the backlog to half the
// bound and no further, and the gateway never runs dry.
type overloadDetector struct {
	lag, hold time.Duration
	highSince time.Time // zero: the lag is not past the bound
	over      bool
	leftAt    time.Time
}

// reset forgets every sample: overload is off and the next lag past the
// bound waits the whole hold.
func (d *overloadDetector) reset() { d.highSince, d.over, d.leftAt = time.Time{}, false, time.Time{} }

// observe feeds one sample taken at now and returns whether the gateway
// reports overload.
func (d *overloadDetector) observe(now time.Time, lag time.Duration) bool {
	if d.lag <= 0 {
		return false
	}
	switch {
	case lag > d.lag:
		if d.highSince.IsZero() {
			d.highSince = now
		}
		if !d.over && (now.Sub(d.highSince) >= d.hold || (!d.leftAt.IsZero() && now.Sub(d.leftAt) < overloadRearm)) {
			d.over = true
		}
	case d.over && lag < d.lag/2:
		d.over, d.leftAt, d.highSince = false, now, time.Time{}
	case !d.over:
		d.highSince = time.Time{}
	}
	return d.over
}

// loadLoop measures the lag every tick, keeps the metrics, and publishes
// the row when the overload it reports changes (and every loadRefresh).
func (g *Gateway) loadLoop(ctx context.Context) {
	t := g.clock.NewTicker(loadTick)
	defer t.Stop()
	det := overloadDetector{lag: g.cfg.OverloadLag, hold: g.cfg.OverloadHold}
	var (
		published     bool
		publishedAt   time.Time
		publishedOver bool
		wasOver       bool
	)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.Chan():
		}
		now := g.clock.Now()
		lag := g.waits.take() + g.ingest.oldest()
		if g.Fenced() {
			// Without its lease the gateway dispatches nothing and its
			// row is not trusted; what it waited through (a database
			// outage, a pause) is no overload, so the hold starts over.
			det.reset()
			lag = 0
		}
		over := det.observe(now, lag)
		g.m.lag.Set(lag.Seconds())
		if over {
			g.m.overloaded.Set(1)
		} else {
			g.m.overloaded.Set(0)
		}
		if over != wasOver {
			g.log.Info("gateway overload", "overloaded", over, "lag", lag.Round(time.Millisecond))
		}
		wasOver = over
		if g.Fenced() || (published && over == publishedOver && now.Sub(publishedAt) < loadRefresh) {
			continue
		}
		if err := g.publishLoad(ctx, lag, over); err != nil {
			if ctx.Err() == nil && !g.Fenced() {
				g.log.Warn("publish gateway load failed; next tick retries", "err", err)
			}
			continue
		}
		published, publishedAt, publishedOver = true, now, over
	}
}

// publishLoad writes the gateway_load row, fenced on the gateway lease; a
// database that does not answer holds the loop for loadRefresh at most.
func (g *Gateway) publishLoad(ctx context.Context, lag time.Duration, over bool) error {
	ctx, cancel := context.WithTimeout(ctx, loadRefresh)
	defer cancel()
	l, _ := g.keeper.Current()
	return g.runFenced(ctx, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, publishLoadSQL, g.id, l.Epoch, min(lag.Milliseconds(), 1<<31-1), over)
		return err
	})
}
