package gateway

// Clock skew: each node's clock against the database's, measured from its
// heartbeats, and the gateway's own against compute_now(), measured by the
// liveness write. Leases never depend on either (time is the database's);
// they are reported because certificates, local timers and logs do, through
// node_sessions.clock_skew_ms to leasehold-doctor (nodes.clock_skew) and on
// /metrics.

import (
	"math"
	"time"
)

// noSkew marks a session whose node has sent no usable heartbeat yet.
const noSkew = math.MinInt64

// observeSkew records the node's clock minus the database's from a
// heartbeat sent at sentAt (the node's clock) and received at recv (this
// process's clock): sentAt - recv is the node against this gateway (one-way
// latency aside, milliseconds on a network that carries sessions), plus the
// gateway's own skew against the database.
func (g *Gateway) observeSkew(s *session, sentAt, recv time.Time) {
	if sentAt.IsZero() || sentAt.Unix() <= 0 {
		return
	}
	s.skew.Store(int64(sentAt.Sub(recv)) + g.ownSkew.Load())
}

// skewMillis is the session's last measured skew in milliseconds, clamped
// to the column's range; ok is false before the first heartbeat.
func (s *session) skewMillis() (ms int32, ok bool) {
	v := s.skew.Load()
	if v == noSkew {
		return 0, false
	}
	m := v / int64(time.Millisecond)
	return int32(max(min(m, math.MaxInt32), math.MinInt32)), true
}

// observeOwnSkew records this process's clock minus the database's from a
// statement sent at sent, answered at recv, whose compute_now() was dbNow:
// the midpoint of the round trip against dbNow.
func (g *Gateway) observeOwnSkew(sent, recv, dbNow time.Time) {
	skew := sent.Add(recv.Sub(sent) / 2).Sub(dbNow)
	g.ownSkew.Store(int64(skew))
	g.m.clockSkew.Set(skew.Seconds())
}

func abs(v int64) int64 {
	if v < 0 {
		return -v
	}
	return v
}
