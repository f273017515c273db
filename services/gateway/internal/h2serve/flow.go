package h2serve

// Flow control: the connection and stream windows in both directions, the
// WINDOW_UPDATEs that return consumed bytes, and the send credit writers wait for.

import (
	"math"
	"time"

	"golang.org/x/net/http2"
)

func (c *conn) handleWindowUpdate(f *http2.WindowUpdateFrame) error {
	inc := int64(f.Increment)
	c.mu.Lock()
	defer c.mu.Unlock()
	if f.StreamID == 0 {
		if int64(c.sendWindow)+inc > math.MaxInt32 {
			return connError{http2.ErrCodeFlowControl, "connection window overflow"}
		}
		c.sendWindow += int32(inc)
		c.broadcastLocked()
		return nil
	}
	if f.StreamID > c.maxSeen {
		return connError{http2.ErrCodeProtocol, "WINDOW_UPDATE on an idle stream"}
	}
	s := c.findLocked(f.StreamID)
	if s == nil {
		return nil
	}
	if int64(s.sendWindow)+inc > math.MaxInt32 {
		return http2.StreamError{StreamID: f.StreamID, Code: http2.ErrCodeFlowControl}
	}
	s.sendWindow += int32(inc)
	c.broadcastLocked()
	return nil
}

// credit returns n consumed bytes to the peer's windows (the stream's
// unless s is nil or done sending), sending WINDOW_UPDATE in batches.
func (c *conn) credit(s *stream, n int) {
	if n <= 0 {
		return
	}
	var connInc, streamInc uint32
	c.mu.Lock()
	c.unackedConn += int32(n)
	if c.unackedConn >= connWindow/4 {
		connInc = uint32(c.unackedConn)
		c.recvWindow += c.unackedConn
		c.unackedConn = 0
	}
	if s != nil && !s.remoteClosed && !s.reset {
		s.unacked += int32(n)
		if s.unacked >= streamWindow/2 {
			streamInc = uint32(s.unacked)
			s.recvWindow += s.unacked
			s.unacked = 0
		}
	}
	closed := c.closed
	c.mu.Unlock()
	if (connInc == 0 && streamInc == 0) || closed {
		return
	}
	_ = c.writeFrames(func(fr *http2.Framer) error {
		if connInc > 0 {
			if err := fr.WriteWindowUpdate(0, connInc); err != nil {
				return err
			}
		}
		if streamInc > 0 {
			return fr.WriteWindowUpdate(s.id, streamInc)
		}
		return nil
	})
}

// takeSendCredit waits until s may send and reserves up to n bytes of
// both windows. A wait longer than the write timeout resets the stream.
func (c *conn) takeSendCredit(s *stream, n int) (int, error) {
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		c.mu.Lock()
		if s.resetErr != nil {
			err := s.resetErr
			c.mu.Unlock()
			return 0, err
		}
		if c.closed {
			c.mu.Unlock()
			return 0, errConnClosed
		}
		avail := min(int64(c.sendWindow), int64(s.sendWindow), int64(n), maxFrameSize)
		if avail > 0 {
			c.sendWindow -= int32(avail)
			s.sendWindow -= int32(avail)
			c.mu.Unlock()
			return int(avail), nil
		}
		if c.flowCh == nil {
			c.flowCh = make(chan struct{})
		}
		ch := c.flowCh
		c.mu.Unlock()
		if timer == nil {
			timer = time.NewTimer(orDefault(c.srv.WriteTimeout, DefaultWriteTimeout))
		}
		select {
		case <-ch:
		case <-timer.C:
			c.srv.Logger.Debug("h2serve: flow-control wait timed out", "remote", c.remoteAddr, "stream", s.id)
			c.resetStream(s, http2.ErrCodeCancel, errFlowTimeout, true)
			return 0, errFlowTimeout
		}
	}
}

// hasSendCredit reports whether s could send DATA now.
func (c *conn) hasSendCredit(s *stream) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sendWindow > 0 && s.sendWindow > 0
}

// returnConnCredit gives back connection send window taken for DATA that
// was not sent (its stream's window no longer matters).
func (c *conn) returnConnCredit(n int) {
	if n <= 0 {
		return
	}
	c.mu.Lock()
	c.sendWindow += int32(n)
	c.broadcastLocked()
	c.mu.Unlock()
}
