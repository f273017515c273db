package h2serve

// Keepalive: one timer per connection (no goroutine while it waits) sends
// PINGs to an idle peer, closes a peer that does not answer, and closes an
// idle connection.

import (
	"math"
	"time"

	"golang.org/x/net/http2"
)

// pingPayload is the data of the server's keepalive PINGs.
var pingPayload = [8]byte{'h', '2', 's', 'e', 'r', 'v', 'e', 0}

func (c *conn) touch() { c.lastRead.Store(time.Now().UnixNano()) }

func (c *conn) startTimer() {
	srv := c.srv
	if srv.PingInterval < 0 && srv.IdleTimeout <= 0 {
		return
	}
	d := orDefault(srv.PingInterval, DefaultPingInterval)
	if srv.PingInterval < 0 || (srv.IdleTimeout > 0 && srv.IdleTimeout < d) {
		d = srv.IdleTimeout
	}
	c.mu.Lock()
	if !c.closed {
		c.timer = time.AfterFunc(d, c.keepalive)
	}
	c.mu.Unlock()
}

// keepalive runs on the connection's timer (no goroutine while it waits):
// it PINGs a connection that has been silent for PingInterval, closes one
// whose PING is not acknowledged within PingTimeout, and closes one
// without streams for IdleTimeout.
func (c *conn) keepalive() {
	srv := c.srv
	now := time.Now()
	pingTimeout := orDefault(srv.PingTimeout, DefaultPingTimeout)
	if sent := c.pingSent.Load(); sent != 0 {
		if waited := now.Sub(time.Unix(0, sent)); waited >= pingTimeout {
			srv.Logger.Debug("h2serve: closing a connection that did not answer PING", "remote", c.remoteAddr, "waited", waited)
			c.closeWith(errPingTimeout)
		} else {
			c.rearm(pingTimeout - waited)
		}
		return
	}
	c.mu.Lock()
	idleFor := time.Duration(0)
	if c.handlers == 0 && !c.idleSince.IsZero() {
		idleFor = now.Sub(c.idleSince)
	}
	closed := c.closed || c.closing
	c.mu.Unlock()
	if closed {
		return
	}
	if srv.IdleTimeout > 0 && idleFor >= srv.IdleTimeout {
		c.startGoAway()
		c.closeGraceful()
		return
	}
	next := time.Duration(math.MaxInt64)
	if srv.IdleTimeout > 0 {
		if idleFor > 0 {
			next = srv.IdleTimeout - idleFor
		} else {
			next = srv.IdleTimeout
		}
	}
	if srv.PingInterval >= 0 {
		interval := orDefault(srv.PingInterval, DefaultPingInterval)
		silent := now.Sub(time.Unix(0, c.lastRead.Load()))
		if silent >= interval {
			c.pingSent.Store(now.UnixNano())
			if err := c.writeFrames(func(fr *http2.Framer) error { return fr.WritePing(false, pingPayload) }); err != nil {
				return
			}
			next = min(next, pingTimeout)
		} else {
			next = min(next, interval-silent)
		}
	}
	c.rearm(next)
}

func (c *conn) rearm(d time.Duration) {
	c.mu.Lock()
	if !c.closed && c.timer != nil {
		c.timer.Reset(d)
	}
	c.mu.Unlock()
}
