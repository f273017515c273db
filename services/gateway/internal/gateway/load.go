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
//
// That lag does not see a queue behind full windows: once every window is
// full, a command waits for a result to free its node's window, and the
// lag counts only from that moment, however many commands are queued
// behind it. So while the gateway reports overload, and for the rearm time
// after, it also measures the queue wait: the commands pending for the
// nodes whose windows it has to free (every session but those whose window
// is full of commands the node has acknowledged, which are running what
// they were given) over the results it read in the last second. Overload
// ends only once that wait, too, is under the bound, and within the rearm
// time a wait past twice the bound reports it again.

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
	// maxQueueWait caps the queue wait measured (and the rows counted
	// for it: this many seconds of results).
	maxQueueWait = time.Minute
)

// queuedSQL counts the pending commands of the nodes $1, up to $2: index
// probes of commands_pending_idx, once a tick and only around an overload.
const queuedSQL = `
SELECT count(*) FROM (SELECT 1 FROM commands WHERE state = 'pending' AND node_id = ANY($1::text[]) LIMIT $2) q`

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

// overloadDetector turns the samples taken every tick into the overload
// the gateway reports. Overload starts once the lag has stayed past lag for
// hold. From then on, and for overloadRearm after it ends, the queue wait
// is counted, and while it is the queue decides: overload ends once the
// queue wait is under lag, so the api's refusals drain the backlog to about
// a second of work and no further, and the gateway never runs dry; within
// the rearm time a queue wait past twice lag starts it again at once. A tick
// whose count failed falls back on the lag: overload ends once the lag is
// under half of lag, and within the rearm time a lag past lag starts it
// again at once. The lag does not end an overload while the queue is
// counted: a gateway whose queue is empty gains nothing from refusals, however
// slowly it dispatches.
type overloadDetector struct {
	lag, hold time.Duration
	highSince time.Time // zero: the lag is not past the bound
	over      bool
	leftAt    time.Time
}

// loadSample is one tick's measurement: the lag, and the queue wait when
// counted is set.
type loadSample struct {
	lag, queue time.Duration
	counted    bool
}

// reset forgets every sample: overload is off and the next lag past the
// bound waits the whole hold.
func (d *overloadDetector) reset() { d.highSince, d.over, d.leftAt = time.Time{}, false, time.Time{} }

// rearming says overload ended less than overloadRearm before now.
func (d *overloadDetector) rearming(now time.Time) bool {
	return !d.leftAt.IsZero() && now.Sub(d.leftAt) < overloadRearm
}

// measuresQueue says whether the sample at now needs the queue wait:
// while overloaded and while rearming. Otherwise it is not counted, and
// costs the database nothing.
func (d *overloadDetector) measuresQueue(now time.Time) bool {
	return d.lag > 0 && (d.over || d.rearming(now))
}

// observe feeds the sample taken at now and returns whether the gateway
// reports overload.
func (d *overloadDetector) observe(now time.Time, s loadSample) bool {
	if d.lag <= 0 {
		return false
	}
	rearming := d.rearming(now)
	var high, low bool
	switch {
	case (d.over || rearming) && s.counted:
		high, low = s.queue > 2*d.lag, s.queue < d.lag
	default:
		high, low = s.lag > d.lag, s.lag < d.lag/2
	}
	switch {
	case d.over:
		if low {
			d.over, d.leftAt, d.highSince = false, now, time.Time{}
		}
	case high:
		if d.highSince.IsZero() {
			d.highSince = now
		}
		d.over = rearming || now.Sub(d.highSince) >= d.hold
	default:
		d.highSince = time.Time{}
	}
	return d.over
}

// queueWait is how long the commands pending for the nodes whose windows
// the gateway has to free wait at the rate it read results in the last
// tick (read; at least one), up to maxQueueWait; ok is false when the
// count failed, and the lag decides that tick.
func (g *Gateway) queueWait(ctx context.Context, read int64) (wait time.Duration, ok bool) {
	g.mu.Lock()
	sessions := make([]*session, 0, len(g.sessions))
	for _, s := range g.sessions {
		sessions = append(sessions, s)
	}
	g.mu.Unlock()
	ids := make([]string, 0, len(sessions))
	for _, s := range sessions {
		if !s.runningOwnWork() {
			ids = append(ids, s.nodeID)
		}
	}
	if len(ids) == 0 {
		return 0, true
	}
	rate := max(read, 1)
	ctx, cancel := context.WithTimeout(ctx, loadTick)
	defer cancel()
	var n int64
	if err := g.db.QueryRow(ctx, queuedSQL, ids, rate*int64(maxQueueWait/loadTick)).Scan(&n); err != nil {
		if ctx.Err() == nil {
			g.log.Debug("count the queue behind full windows", "err", err)
		}
		return 0, false
	}
	return time.Duration(n) * loadTick / time.Duration(rate), true
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
		publishedLag  time.Duration
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
		read := g.resultsRead.Swap(0)
		var (
			queue   time.Duration
			counted bool
		)
		if g.Fenced() {
			// Without its lease the gateway dispatches nothing and its
			// row is not trusted; what it waited through (a database
			// outage, a pause) is no overload, so the hold starts over.
			det.reset()
			lag = 0
		} else if det.measuresQueue(now) {
			queue, counted = g.queueWait(ctx, read)
		}
		over := det.observe(now, loadSample{lag: lag, queue: queue, counted: counted})
		g.m.lag.Set(lag.Seconds())
		g.m.queueWait.Set(queue.Seconds())
		// What is published is the longer wait: the api's Retry-After
		// sends a refused caller back about when the queue is gone.
		lag = max(lag, queue)
		if over {
			g.m.overloaded.Set(1)
		} else {
			g.m.overloaded.Set(0)
		}
		if over != wasOver {
			g.log.Info("gateway overload", "overloaded", over, "lag", lag.Round(time.Millisecond), "queue_wait", queue.Round(time.Millisecond))
		}
		wasOver = over
		current := published && over == publishedOver && now.Sub(publishedAt) < loadRefresh
		if over && waitMoved(publishedLag, lag) {
			current = false
		}
		if g.Fenced() || current {
			continue
		}
		if err := g.publishLoad(ctx, lag, over); err != nil {
			if ctx.Err() == nil && !g.Fenced() {
				g.log.Warn("publish gateway load failed; next tick retries", "err", err)
			}
			continue
		}
		published, publishedAt, publishedOver, publishedLag = true, now, over, lag
	}
}

// waitMoved says a published wait is off by half or more, or by a second or
// more, from the current one: while overloaded the row is written again, so
// the api's Retry-After follows the queue.
func waitMoved(published, now time.Duration) bool {
	d := max(published, now) - min(published, now)
	return d > 0 && (d >= time.Second || 2*d >= max(published, now))
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
