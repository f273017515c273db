package gateway

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

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
		require.Equal(t, s.want, d.observe(at(s.sec), s.lag), "at %ds, lag %s: %s", s.sec, s.lag, s.why)
	}
	require.True(t, d.observe(at(100), 5*time.Second), "one more second past the bound")
	d.reset()
	require.False(t, d.observe(at(101), 5*time.Second), "after a reset (the lease lost) the hold starts over, with no rearm")
	off := overloadDetector{hold: 0}
	require.False(t, off.observe(t0, time.Hour), "a bound of 0 never reports overload")
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

	s.sending("a", "b")
	require.True(t, s.answered("a", now.Add(-100*time.Millisecond)), "the window was full")
	require.Equal(t, 100*time.Millisecond, waitedForGateway(time.Minute, s, now), "only since the window opened")
	require.False(t, s.answered("b", now), "the window was not full: room is as old as before")
	require.Equal(t, 100*time.Millisecond, waitedForGateway(time.Minute, s, now))
	require.Equal(t, time.Duration(0), waitedForGateway(-time.Second, s, now), "never negative (a skewed clock)")
}

// TestGatewayPublishesOverload: a gateway whose node had room while a
// command waited 30 s for it reports overload in gateway_load (fenced, with
// its lease epoch, the lag in milliseconds) and in its metrics; once nothing
// waits any more it reports it no longer.
func TestGatewayPublishesOverload(t *testing.T) {
	t.Parallel()
	cfg := windowConfig(32)
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
		`INSERT INTO commands (node_id, kind, created_at) VALUES ('n-0', 'exec', compute_now() - interval '30 seconds') RETURNING id`).Scan(&id))
	g.wakeDispatch("n-0")
	require.Equal(t, id, recvCommand(t, s))

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
