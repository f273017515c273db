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
// nodes whose queue waits for it (session.queueIsGateways: a window with
// room, or one holding an ack the gateway has not read; not a window full
// of commands the node acknowledged and is running) over the results it
// read a second. Results waiting for the group commit are left out, as the
// lag's dispatch part is: on a gateway short of CPU they wait for it
// however short the queue, and refusals do not shorten that; a database
// slow to take them slows completions, and the queue grows. That wait
// decides: overload ends once it is under the bound,
// whatever the lag, and within the rearm time a wait past twice the bound
// reports it again (overloadDetector).

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
	// for it: this many seconds of results): the api's Retry-After goes
	// no higher, and the decisions need no more than twice the bound.
	maxQueueWait = 10 * time.Second
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
// without a count falls back on the lag: overload ends once the lag is
// under half of lag, and within the rearm time a lag past lag starts it
// again at once (a failed count stands on the last one for countValid
// first). The lag does not end an overload while the queue is counted: a
// gateway whose queue is empty gains nothing from refusals, however slowly
// it dispatches.
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

// queueWait is how long the commands pending for the nodes whose queue
// waits for the gateway (session.queueIsGateways) wait at rate, the results
// it reads a second, up to maxQueueWait; ok is false when the count failed.
func (g *Gateway) queueWait(ctx context.Context, now time.Time, rate float64) (wait time.Duration, ok bool) {
	sessions := g.snapshot()
	ids := make([]string, 0, len(sessions))
	for _, s := range sessions {
		if s.queueIsGateways(now, g.cfg.OverloadLag) {
			ids = append(ids, s.nodeID)
		}
	}
	if len(ids) == 0 {
		return 0, true
	}
	rate = max(rate, 1)
	ctx, cancel := context.WithTimeout(ctx, loadTick)
	defer cancel()
	var n int64
	if err := g.db.QueryRow(ctx, queuedSQL, ids, int64(rate*maxQueueWait.Seconds())+1).Scan(&n); err != nil {
		if ctx.Err() == nil {
			g.log.Debug("count the queue behind full windows", "err", err)
		}
		return 0, false
	}
	return min(time.Duration(float64(n)/rate*float64(time.Second)), maxQueueWait), true
}

// drainRate is the results read a second over the last few ticks: one
// tick's count swings with bursts and pauses, and a queue divided by a
// tick that read nothing would read as many seconds as commands.
type drainRate struct {
	reads [3]int64
	n     int
}

// add records one tick's results and returns the mean over the ticks kept.
func (r *drainRate) add(read int64) float64 {
	copy(r.reads[1:], r.reads[:len(r.reads)-1])
	r.reads[0] = read
	r.n = min(r.n+1, len(r.reads))
	var sum int64
	for _, v := range r.reads[:r.n] {
		sum += v
	}
	return float64(sum) / float64(r.n)
}

// lastCount keeps the last queue wait counted, for a tick whose count
// fails: a count that timed out on a busy database is not a queue of
// nothing, so the last one stands for countValid before the lag decides.
type lastCount struct {
	wait time.Duration
	at   time.Time
}

// countValid is how long a counted queue wait stands for failed counts.
const countValid = 5 * time.Second

// loadLoop measures the lag every tick, keeps the metrics, and publishes
// the row when the overload it reports changes (and every loadRefresh).
func (g *Gateway) loadLoop(ctx context.Context) {
	t := g.clock.NewTicker(loadTick)
	defer t.Stop()
	det := overloadDetector{lag: g.cfg.OverloadLag, hold: g.cfg.OverloadHold}
	var (
		drained       drainRate
		last          lastCount
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
		rate := drained.add(g.resultsRead.Swap(0))
		var (
			queue   time.Duration
			counted bool
		)
		if g.Fenced() {
			// Without its lease the gateway dispatches nothing and its
			// row is not trusted; what it waited through (a database
			// outage, a pause) is no overload, so the hold starts over.
			det.reset()
			lag, last = 0, lastCount{}
		} else if det.measuresQueue(now) {
			if queue, counted = g.queueWait(ctx, now, rate); counted {
				last = lastCount{wait: queue, at: now}
			} else if !last.at.IsZero() && now.Sub(last.at) < countValid {
				queue, counted = last.wait, true
			}
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
// more, from the current one, both taken up to maxQueueWait (the api's
// Retry-After goes no higher): while overloaded the row is written again,
// so the api's Retry-After follows the queue.
func waitMoved(published, now time.Duration) bool {
	published, now = min(published, maxQueueWait), min(now, maxQueueWait)
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
