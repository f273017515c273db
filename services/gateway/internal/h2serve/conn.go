package h2serve

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

var (
	errPingTimeout  = errors.New("h2serve: no PING acknowledgement in time")
	errConnClosed   = errors.New("h2serve: connection closed")
	errStreamReset  = errors.New("h2serve: stream reset by peer")
	errStreamDone   = errors.New("h2serve: handler returned")
	errFlowTimeout  = errors.New("h2serve: peer granted no flow-control window within the write timeout")
	errHandlerPanic = errors.New("h2serve: handler panicked")
	errBodyClosed   = errors.New("h2serve: request body closed")
)

// connError is a connection error: GOAWAY with code, then close.
type connError struct {
	code   http2.ErrCode
	reason string
}

func (e connError) Error() string {
	return fmt.Sprintf("h2serve: connection error %s: %s", e.code, e.reason)
}

// conn is one HTTP/2 connection. Its reader goroutine (serve) owns fr and
// hdec; the write side (hpack encoder, the net.Conn's writes) is guarded
// by wmu; everything else by mu. Lock order: never take wmu while
// holding mu.
type conn struct {
	srv        *Server
	nc         net.Conn // the tls.Conn over TLS
	raw        net.Conn // the accepted connection
	tlsState   *tls.ConnectionState
	remoteAddr string
	base       context.Context // parent of request contexts

	fr   *http2.Framer // reader goroutine only
	hdec *hpack.Decoder

	lastRead atomic.Int64 // unix nanos of the last frame read
	pingSent atomic.Int64 // unix nanos of the outstanding PING, 0: none

	wmu   sync.Mutex
	werr  error
	henc  *hpack.Encoder
	hsink hpackSink

	mu          sync.Mutex
	streams     []*stream // open streams (not reset), by id
	handlers    int       // running handlers
	maxSeen     uint32
	sendWindow  int32 // connection send window
	recvWindow  int32 // connection receive window the peer has
	unackedConn int32 // consumed bytes not yet returned by WINDOW_UPDATE
	peerInit    int32 // peer's SETTINGS_INITIAL_WINDOW_SIZE
	flowCh      chan struct{}
	goAwaySent  bool // new streams are refused: a GOAWAY is on its way
	// goAwayOut: our GOAWAY is written, so an idle connection may close.
	// Until then a stream finishing must not close it (the peer would
	// read EOF where it should read GOAWAY and its code).
	goAwayOut   bool
	settingsOut bool // our SETTINGS are written: GOAWAY may follow
	peerGoAway  bool
	closing     bool
	closed      bool
	idleSince   time.Time
	timer       *time.Timer
	// cutShort are the last streams closed before the peer ended them
	// (reset, refused, or the handler returned first): HEADERS still
	// arriving for them are trailers in flight, a stream error only.
	cutShort     [8]uint32
	cutShortNext uint8
}

func (s *Server) newConn(nc net.Conn) *conn {
	base := s.BaseContext
	if base == nil {
		base = context.Background()
	}
	c := &conn{
		srv: s, nc: nc, raw: nc, remoteAddr: nc.RemoteAddr().String(), base: base,
		sendWindow: 65535, recvWindow: 65535, peerInit: 65535, idleSince: time.Now(),
	}
	if size := s.headerTable(); size > 0 {
		c.henc = hpack.NewEncoder(&c.hsink)
		c.henc.SetMaxDynamicTableSizeLimit(size)
	} // else header blocks use a pooled encoder that never indexes

	return c
}

// serve is the connection's reader goroutine. Over TLS it first runs the
// handshake, then hands the connection to a fresh goroutine: the
// handshake's deep crypto calls would otherwise leave the reader, for the
// connection's whole life, with a stack twice as large as it needs.
func (c *conn) serve() {
	if c.srv.TLSConfig != nil && c.tlsState == nil {
		rht := orDefault(c.srv.ReadHeaderTimeout, DefaultReadHeaderTimeout)
		_ = c.nc.SetDeadline(time.Now().Add(rht))
		if err := c.handshake(rht); err != nil {
			c.srv.Logger.Debug("h2serve: TLS handshake", "remote", c.remoteAddr, "err", err)
			c.closeWith(err)
			c.srv.removeConn(c)
			c.srv.serving.Done()
			return
		}
		go c.serve()
		return
	}
	c.serveFrames()
}

func (c *conn) handshake(timeout time.Duration) error {
	cfg := c.srv.TLSConfig
	if !containsString(cfg.NextProtos, "h2") {
		cfg = cfg.Clone()
		cfg.NextProtos = append([]string{"h2"}, cfg.NextProtos...)
	}
	tc := tls.Server(c.raw, cfg)
	ctx, cancel := context.WithTimeout(c.base, timeout)
	defer cancel()
	if err := tc.HandshakeContext(ctx); err != nil {
		return fmt.Errorf("h2serve: TLS handshake: %w", err)
	}
	cs := tc.ConnectionState()
	if cs.NegotiatedProtocol != "h2" {
		return fmt.Errorf("h2serve: client negotiated %q, not h2 (HTTP/1 is not served)", cs.NegotiatedProtocol)
	}
	c.mu.Lock() // closeWith may run meanwhile (Server.Close)
	closed := c.closed
	c.nc, c.tlsState = tc, &cs
	c.mu.Unlock()
	if closed {
		return errConnClosed
	}
	return nil
}

func containsString(ss []string, s string) bool {
	for _, v := range ss {
		if v == s {
			return true
		}
	}
	return false
}

// readError turns a framer read error into the connection's end, sending
// GOAWAY for protocol errors.
func (c *conn) readError(err error) error {
	var ce http2.ConnectionError
	switch {
	case errors.As(err, &ce):
		return c.fail(connError{http2.ErrCode(ce), "framer: " + err.Error()})
	case errors.Is(err, http2.ErrFrameTooLarge):
		return c.fail(connError{http2.ErrCodeFrameSize, "frame larger than SETTINGS_MAX_FRAME_SIZE"})
	}
	var se http2.StreamError
	if errors.As(err, &se) {
		// The first frame, or one on an even stream: later ones on client
		// streams are handled in the loop.
		return c.fail(connError{http2.ErrCodeProtocol, err.Error()})
	}
	c.srv.Logger.Debug("h2serve: read", "remote", c.remoteAddr, "err", err)
	return fmt.Errorf("h2serve: read frame: %w", err)
}

// fail sends GOAWAY for a connection error and returns the error.
func (c *conn) fail(err error) error {
	var ce connError
	if errors.As(err, &ce) {
		c.mu.Lock()
		last := c.maxSeen
		c.goAwaySent = true
		settingsOut := c.settingsOut
		c.mu.Unlock()
		if !settingsOut {
			return err
		}
		c.srv.Logger.Debug("h2serve: connection error", "remote", c.remoteAddr, "code", ce.code, "reason", ce.reason)
		if c.writeFrames(func(fr *http2.Framer) error { return fr.WriteGoAway(last, ce.code, []byte(ce.reason)) }) == nil {
			c.linger()
		}
	}
	return err
}

// linger half-closes the connection and reads (and drops) what the peer
// still sends for up to a second, so that closing does not reset the
// connection before the peer has read our last frames (GOAWAY).
func (c *conn) linger() {
	c.closeGraceful()
	_, _ = io.CopyN(io.Discard, c.nc, 1<<20)
}

// stream errors from the reader: reset the stream if open, else send
// RST_STREAM anyway.
func (c *conn) streamError(id uint32, code http2.ErrCode) {
	c.mu.Lock()
	if id > c.maxSeen {
		c.maxSeen = id
	}
	s := c.findLocked(id)
	if s == nil {
		c.cutShortLocked(id)
	}
	c.mu.Unlock()
	if s != nil {
		c.resetStream(s, code, fmt.Errorf("h2serve: stream error %s", code), true)
		return
	}
	_ = c.writeFrames(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, code) })
}

func (c *conn) findLocked(id uint32) *stream {
	for _, s := range c.streams {
		if s.id == id {
			return s
		}
	}
	return nil
}

func (c *conn) removeLocked(s *stream) {
	for i, x := range c.streams {
		if x == s {
			last := len(c.streams) - 1
			c.streams[i] = c.streams[last]
			c.streams[last] = nil
			c.streams = c.streams[:last]
			if len(c.streams) == 0 {
				c.streams = nil
			}
			return
		}
	}
}

// broadcastLocked wakes writers waiting for flow-control credit.
func (c *conn) broadcastLocked() {
	if c.flowCh != nil {
		close(c.flowCh)
		c.flowCh = nil
	}
}

// startGoAway sends GOAWAY(NO_ERROR) naming the last stream that will be
// served; later streams are refused. An idle connection is then closed.
func (c *conn) startGoAway() {
	c.mu.Lock()
	if c.goAwaySent || c.closing || c.closed {
		c.mu.Unlock()
		return
	}
	c.goAwaySent = true
	if !c.settingsOut {
		// A GOAWAY may not come before SETTINGS: serve sends it after them.
		c.mu.Unlock()
		return
	}
	last := c.maxSeen
	c.mu.Unlock()
	if c.writeFrames(func(fr *http2.Framer) error { return fr.WriteGoAway(last, http2.ErrCodeNo, nil) }) != nil {
		return // the write closed the connection
	}
	c.mu.Lock()
	c.goAwayOut = true
	idle := c.handlers == 0 // handlers that ended meanwhile left it to us
	c.mu.Unlock()
	if idle {
		c.closeGraceful()
	}
}

// closeIfIdle closes a connection that sent GOAWAY and has no handlers.
func (c *conn) closeIfIdle() {
	c.mu.Lock()
	idle := c.handlers == 0 && c.settingsOut
	c.mu.Unlock()
	if idle {
		c.startGoAway()
		c.closeGraceful()
	}
}

// closeGraceful half-closes the connection (so what was written is not
// lost to a TCP reset) and lets the reader see the peer close, for at
// most a second.
func (c *conn) closeGraceful() {
	c.mu.Lock()
	if c.closing || c.closed {
		c.mu.Unlock()
		return
	}
	c.closing = true
	c.mu.Unlock()
	c.wmu.Lock()
	if c.werr == nil {
		c.werr = errConnClosed
		if tc, ok := c.nc.(*tls.Conn); ok {
			_ = tc.CloseWrite()
		}
		if cw, ok := c.raw.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		}
	}
	c.wmu.Unlock()
	_ = c.nc.SetReadDeadline(time.Now().Add(time.Second))
}

// closeWith closes the connection at once: every stream's context is
// cancelled and its body fails with err.
func (c *conn) closeWith(err error) {
	if err == nil {
		err = errConnClosed
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.closed = true
	streams := c.streams
	c.streams = nil
	for _, s := range streams {
		s.reset = true
		if s.resetErr == nil {
			s.resetErr = err
		}
	}
	c.broadcastLocked()
	if c.timer != nil {
		c.timer.Stop()
	}
	nc := c.nc
	c.mu.Unlock()
	_ = nc.Close()
	for _, s := range streams {
		s.cancel(err)
		s.body.fail(err)
	}
}
