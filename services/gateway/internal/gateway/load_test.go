package gateway

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/semaphore"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestOverloadDetector: overload is reported once the lag has stayed past
// the bound for the hold, not for a shorter burst; it ends once the lag is
// under half the bound (not merely under the bound); within the rearm time
// after it ended a lag past the bound reports it again at once; a bound of
// 0 never reports it.
func TestOverloadDetector(t *testing.T) {
	t0 := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	d := overloadDetector{lag: time.Second, hold: 3 * time.Second}
	steps := []struct {
		sec  int
		lag  time.Duration
		want bool
		why  string
	}{
		{0, 2 * time.Second, false, "past the bound, hold not yet over"},
		{1, 2 * time.Second, false, "still within the hold"},
		{2, 500 * time.Millisecond, false, "a burst of two seconds"},
		{3, 3 * time.Second, false, "past again: the hold starts over"},
		{5, 3 * time.Second, false, "two seconds into the new hold"},
		{6, 3 * time.Second, true, "held for three seconds"},
		{7, 800 * time.Millisecond, true, "under the bound but not under half of it"},
		{8, 400 * time.Millisecond, false, "under half the bound"},
		{9, 1500 * time.Millisecond, true, "within the rearm time: at once"},
		{10, 100 * time.Millisecond, false, "drained"},
		{10 + int(overloadRearm/time.Second) + 1, 5 * time.Second, false, "past the rearm time: the hold again"},
	}
	for _, s := range steps {
		require.Equal(t, s.want, d.observe(at(s.sec), loadSample{lag: s.lag}), "at %ds, lag %s: %s", s.sec, s.lag, s.why)
	}
	require.True(t, d.observe(at(100), loadSample{lag: 5 * time.Second}), "one more second past the bound")
	d.reset()
	require.False(t, d.observe(at(101), loadSample{lag: 5 * time.Second}), "after a reset (the lease lost) the hold starts over, with no rearm")
	off := overloadDetector{hold: 0}
	require.False(t, off.observe(t0, loadSample{lag: time.Hour, queue: time.Hour, counted: true}), "a bound of 0 never reports overload")
	require.False(t, off.measuresQueue(t0), "nor measures a queue")
}

// TestOverloadDetectorWaitsOutTheQueue: once overloaded, and while
// rearming, the queue behind full windows decides when it is counted: a lag
// under half the bound does not end overload while a bound's work or more
// is queued, and a slow dispatch (the lag past the bound) with less than
// that queued does not hold it; within the rearm time a queue past twice
// the bound starts it again at once, a smaller one does not. A tick whose
// count failed falls back on the lag. The queue is counted only while
// overloaded or rearming, and a queue alone never starts an overload.
func TestOverloadDetectorWaitsOutTheQueue(t *testing.T) {
	t0 := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	d := overloadDetector{lag: time.Second, hold: 3 * time.Second}
	require.False(t, d.measuresQueue(at(0)), "not overloaded, never was: no count")
	require.False(t, d.observe(at(0), loadSample{queue: time.Hour, counted: true}), "a queue alone (a node's own backlog) starts no overload")
	const ms = time.Millisecond
	steps := []struct {
		sec    int
		sample loadSample
		want   bool
		why    string
	}{
		{1, loadSample{lag: 2000 * ms}, false, "past the bound, hold not yet over"},
		{4, loadSample{lag: 2000 * ms}, true, "held for three seconds"},
		{5, loadSample{lag: 100 * ms, queue: 8000 * ms, counted: true}, true, "the lag is blind behind full windows; eight seconds queued"},
		{6, loadSample{lag: 100 * ms, queue: 1500 * ms, counted: true}, true, "still more than a bound's work queued"},
		{7, loadSample{lag: 3000 * ms, queue: 900 * ms, counted: true}, false, "under a bound's work queued: a slow dispatch does not hold it"},
		{8, loadSample{lag: 3000 * ms, queue: 1900 * ms, counted: true}, false, "rearming: the queue decides, and under twice the bound is not enough"},
		{9, loadSample{lag: 100 * ms, queue: 2500 * ms, counted: true}, true, "rearming: past twice the bound, at once"},
		{10, loadSample{lag: 800 * ms}, true, "the count failed: the lag decides, and it is not under half the bound"},
		{11, loadSample{lag: 400 * ms}, false, "the count failed again: the lag is under half the bound"},
		{12, loadSample{lag: 1500 * ms}, true, "the count failed while rearming: a lag past the bound, at once"},
		{13, loadSample{queue: 0, counted: true}, false, "drained"},
	}
	for _, s := range steps {
		if s.sec >= 5 {
			require.True(t, d.measuresQueue(at(s.sec)), "at %ds the queue is counted", s.sec)
		}
		require.Equal(t, s.want, d.observe(at(s.sec), s.sample), "at %ds, %+v: %s", s.sec, s.sample, s.why)
	}
	late := at(13).Add(overloadRearm + time.Second)
	require.False(t, d.measuresQueue(late), "past the rearm time the queue is no longer counted")
	require.False(t, d.observe(late, loadSample{lag: 100 * ms, queue: time.Hour, counted: true}), "nor would it report overload")
}

// TestWaitedForGatewayCountsFromTheWindowOpening: a command counts what
// it waited since it was created or since its node's window last had room,
// whichever is later: a node busy with a full window of long commands, or
// one that just connected, adds nothing for the gateway.
func TestWaitedForGatewayCountsFromTheWindowOpening(t *testing.T) {
	now := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	s := &session{window: 2}
	s.roomAt.Store(now.Add(-time.Hour).UnixNano())
	require.Equal(t, 30*time.Second, waitedForGateway(30*time.Second, s, now), "room all along: the whole wait")

	s.roomAt.Store(now.Add(-2 * time.Second).UnixNano()) // the session began 2 s ago
	require.Equal(t, 2*time.Second, waitedForGateway(30*time.Second, s, now), "only since the session began")

	s.sending(now, "a", "b")
	require.True(t, s.answered("a", now.Add(-100*time.Millisecond)), "the window was full")
	require.Equal(t, 100*time.Millisecond, waitedForGateway(time.Minute, s, now), "only since the window opened")
	require.False(t, s.answered("b", now), "the window was not full: room is as old as before")
	require.Equal(t, 100*time.Millisecond, waitedForGateway(time.Minute, s, now))
	require.Equal(t, time.Duration(0), waitedForGateway(-time.Second, s, now), "never negative (a skewed clock)")
}

// overloadCase starts a gateway with a node window of window that reports
// overload at a lag of 200 ms without a hold, connects node n-0 to it, its
// window open for an hour as far as the lag is concerned, and dispatches it
// one command created waited ago; it returns that command's id.
func overloadCase(t *testing.T, window int, waited time.Duration) (*Gateway, *pgtest.DB, *rawSession, string) {
	t.Helper()
	cfg := windowConfig(window)
	cfg.OverloadLag, cfg.OverloadHold = 200*time.Millisecond, 0
	db := pgtest.NewDB(t)
	g := startGateway(t, db, cfg)
	c := &windowCase{g: g, db: db, cred: registerNodes(t, db, "n", 1)[0]}
	s := c.connect(t)
	g.mu.Lock()
	sess := g.sessions["n-0"]
	g.mu.Unlock()
	require.NotNil(t, sess)
	sess.roomAt.Store(time.Now().Add(-time.Hour).UnixNano()) // as if connected, with room, for an hour

	var id string
	require.NoError(t, db.Pool.QueryRow(context.Background(),
		`INSERT INTO commands (node_id, kind, created_at) VALUES ('n-0', 'exec', compute_now() - make_interval(secs => $1)) RETURNING id`,
		waited.Seconds()).Scan(&id))
	g.wakeDispatch("n-0")
	require.Equal(t, id, recvCommand(t, s))
	return g, db, s, id
}

// TestGatewayPublishesOverload: a gateway whose node had room while a
// command waited 30 s for it reports overload in gateway_load (fenced, with
// its lease epoch, the lag in milliseconds) and in its metrics; once nothing
// waits any more it reports it no longer.
func TestGatewayPublishesOverload(t *testing.T) {
	t.Parallel()
	g, db, s, id := overloadCase(t, 32, 30*time.Second)

	row := func() (overloaded bool, lagMS int, epoch int64) {
		err := db.Pool.QueryRow(context.Background(), `SELECT overloaded, lag_ms, lease_epoch FROM gateway_load WHERE gateway_id = $1`, g.id).Scan(&overloaded, &lagMS, &epoch)
		if err != nil {
			return false, 0, 0
		}
		return overloaded, lagMS, epoch
	}
	require.Eventually(t, func() bool { o, _, _ := row(); return o }, 10*time.Second, 20*time.Millisecond, "the gateway never reported overload")
	_, lagMS, epoch := row()
	require.GreaterOrEqual(t, lagMS, 25000, "the lag is the command's 30 s wait")
	l, _ := g.keeper.Current()
	require.Equal(t, l.Epoch, epoch)
	require.Equal(t, 1.0, testutil.ToFloat64(g.m.overloaded))

	sendResult(t, s, id)
	require.Eventually(t, func() bool { o, _, _ := row(); return !o }, 10*time.Second, 20*time.Millisecond, "the gateway never left overload")
	require.Equal(t, 0.0, testutil.ToFloat64(g.m.overloaded))
}

// TestOverloadLastsWhileTheQueueBehindFullWindowsDrains: a gateway that
// reports overload keeps reporting it while commands are queued behind a
// window it has to free, though the lag (which counts only from the
// window's opening) has fallen to nothing; it publishes the queue's wait
// for the api's Retry-After; and once the window is full of commands the
// node has acknowledged (it is running them: the queue is its own), the
// queue no longer counts and overload ends.
func TestOverloadLastsWhileTheQueueBehindFullWindowsDrains(t *testing.T) {
	t.Parallel()
	// One command that waited 5 s while the node had room: overload. It
	// fills the window of one, and 50 more queue behind it.
	g, db, s, first := overloadCase(t, 1, 5*time.Second)
	_, err := db.Pool.Exec(context.Background(), `INSERT INTO commands (node_id, kind) SELECT 'n-0', 'exec' FROM generate_series(1, 50)`)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return testutil.ToFloat64(g.m.overloaded) == 1 }, 10*time.Second, 10*time.Millisecond,
		"the gateway never reported overload")

	// Nothing is dispatched any more, so the lag is nothing, but 50
	// commands wait for a window no result has freed: 50 s at the one
	// result a second counted when none was read, taken as the most that
	// is measured.
	require.Eventually(t, func() bool { return testutil.ToFloat64(g.m.queueWait) >= maxQueueWait.Seconds() }, 10*time.Second, 10*time.Millisecond,
		"the queue behind the full window was never measured")
	require.Less(t, testutil.ToFloat64(g.m.lag), 0.1, "the lag does not see the queue")
	require.Never(t, func() bool { return testutil.ToFloat64(g.m.overloaded) == 0 }, 2500*time.Millisecond, 20*time.Millisecond,
		"overload ended with 50 commands queued behind the window")
	var lagMS int
	require.Eventually(t, func() bool {
		err := db.Pool.QueryRow(context.Background(), `SELECT lag_ms FROM gateway_load WHERE gateway_id = $1 AND overloaded`, g.id).Scan(&lagMS)
		return err == nil && lagMS >= int(maxQueueWait.Milliseconds()) // the first row had the lag, 5 s
	}, loadRefresh/2, 50*time.Millisecond, "the published lag is not the queue's wait, written again when it moved (Retry-After would send callers back too soon)")

	// The node acknowledges: it is running what it was given, and what
	// waits behind it waits for the node.
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandAck{CommandAck: &nodev1.CommandAck{CommandId: first}}}))
	require.Eventually(t, func() bool { return testutil.ToFloat64(g.m.overloaded) == 0 }, 10*time.Second, 10*time.Millisecond,
		"a node's own queue kept the gateway overloaded")
	require.Equal(t, 0.0, testutil.ToFloat64(g.m.queueWait), "nothing the gateway has to free is queued")
}

// TestWaitMovedByHalfOrASecond: the row is written again while overloaded
// when the wait moved by half or more, or by a second or more.
func TestWaitMovedByHalfOrASecond(t *testing.T) {
	const ms = time.Millisecond
	for _, c := range []struct {
		published, now time.Duration
		want           bool
	}{
		{1000 * ms, 1400 * ms, false},
		{1000 * ms, 2000 * ms, true},
		{2000 * ms, 1000 * ms, true},
		{8000 * ms, 8900 * ms, false},
		{8000 * ms, 9000 * ms, true},
		{0, 100 * ms, true},
		{300 * ms, 300 * ms, false},
		{0, 0, false},
	} {
		require.Equal(t, c.want, waitMoved(c.published, c.now), "published %s, now %s", c.published, c.now)
	}
}

// TestQueueIsTheGatewaysUnlessTheNodeHoldsItsWindow: a node's pending
// commands wait for the gateway while its window has room or holds a
// command not acknowledged for longer than the grace (an ack the gateway
// has not read); a window full of acknowledged commands, or of commands
// sent a moment ago (the node has not had the time to ack), is the node's
// own work. A result takes a command out of the window either way.
func TestQueueIsTheGatewaysUnlessTheNodeHoldsItsWindow(t *testing.T) {
	now := time.Date(2026, 12, 8, 12, 0, 0, 0, time.UTC)
	grace := time.Second
	s := &session{window: 2}
	require.True(t, s.queueIsGateways(now, grace), "an empty window has room")
	s.sending(now.Add(-5*time.Second), "a")
	require.True(t, s.queueIsGateways(now, grace), "room for one more")
	s.sending(now.Add(-100*time.Millisecond), "b")
	require.True(t, s.queueIsGateways(now, grace), "full, but a has waited 5 s for an ack")
	s.acknowledged("a")
	require.False(t, s.queueIsGateways(now, grace), "full: a acknowledged, b sent a moment ago")
	require.True(t, s.queueIsGateways(now.Add(2*time.Second), grace), "b's ack is now late")
	s.acknowledged("b")
	s.acknowledged("unknown")
	s.sending(now, "a") // sent again: counts once, stays acknowledged
	require.False(t, s.queueIsGateways(now.Add(time.Hour), grace), "both acknowledged: the node runs them")
	require.True(t, s.answered("a", now), "a result opens the full window")
	require.True(t, s.queueIsGateways(now, grace), "room again")
}

// TestHelloListedReplaysCountAsAcknowledged: a node that redials lists the
// commands it holds; their replays count into the window as acknowledged,
// because the daemon does not acknowledge a command it already runs, so a
// node running long commands through a redial is not taken for a gateway
// that has not read its acks.
func TestHelloListedReplaysCountAsAcknowledged(t *testing.T) {
	t.Parallel()
	g := startGateway(t, pgtest.NewDB(t), testConfig())
	s := &session{nodeID: "n-replay", epoch: 1, window: 2,
		reports: semaphore.NewWeighted(1 << 20), reportBudget: 1 << 20, output: semaphore.NewWeighted(sessionOutputBudget),
		send: func(*nodev1.ConnectResponse) error { return nil }, breakRecv: func() {},
		heldAtHello: map[string]struct{}{"running-1": {}, "running-2": {}}}
	s.generation = g.generation.Load()
	replays := []*nodev1.Command{{CommandId: "running-1"}, {CommandId: "running-2"}}
	require.True(t, g.registerSession(s, &nodev1.Welcome{SessionEpoch: 1, GatewayId: g.id}, replays))
	t.Cleanup(func() { s.close(nil); _ = s.finish() })
	require.False(t, s.queueIsGateways(time.Now().Add(time.Hour), time.Second), "the node holds both replays: its queue is its own")
	require.Nil(t, s.heldAtHello, "the Hello's list is dropped once counted")

	other := &session{nodeID: "n-replay-2", epoch: 1, window: 2,
		reports: semaphore.NewWeighted(1 << 20), reportBudget: 1 << 20, output: semaphore.NewWeighted(sessionOutputBudget),
		send: func(*nodev1.ConnectResponse) error { return nil }, breakRecv: func() {}}
	other.generation = g.generation.Load()
	require.True(t, g.registerSession(other, &nodev1.Welcome{SessionEpoch: 1, GatewayId: g.id}, []*nodev1.Command{{CommandId: "x"}, {CommandId: "y"}}))
	t.Cleanup(func() { other.close(nil); _ = other.finish() })
	require.True(t, other.queueIsGateways(time.Now().Add(time.Hour), time.Second), "replays the node did not list wait for its ack")
}

// TestDrainRateIsTheMeanOfTheLastTicks: the rate a queue is divided by is
// the mean of the last three ticks' results, so a tick that read nothing
// (a burst ended, a pause) does not turn the queue into as many seconds as
// commands.
func TestDrainRateIsTheMeanOfTheLastTicks(t *testing.T) {
	var r drainRate
	require.Equal(t, 900.0, r.add(900), "one tick: itself")
	require.Equal(t, 600.0, r.add(300))
	require.Equal(t, 400.0, r.add(0), "a tick that read nothing")
	require.Equal(t, 100.0, r.add(0), "the first tick has left the mean")
	require.Equal(t, 0.0, r.add(0))
}
