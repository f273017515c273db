package h2serve

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

var (
	errPingTimeout   = errors.New("h2serve: no PING acknowledgement in time")
	errConnClosed    = errors.New("h2serve: connection closed")
	errStreamReset   = errors.New("h2serve: stream reset by peer")
	errStreamDone    = errors.New("h2serve: handler returned")
	errFlowTimeout   = errors.New("h2serve: peer granted no flow-control window within the write timeout")
	errHandlerPanic  = errors.New("h2serve: handler panicked")
	errBodyClosed    = errors.New("h2serve: request body closed")
	errStreamRefused = errors.New("h2serve: stream refused")
)

// connError is a connection error: GOAWAY with code, then close.
type connError struct {
	code   http2.ErrCode
	reason string
}

func (e connError) Error() string {
	return fmt.Sprintf("h2serve: connection error %s: %s", e.code, e.reason)
}

// pingPayload is the data of the server's keepalive PINGs.
var pingPayload = [8]byte{'h', '2', 's', 'e', 'r', 'v', 'e', 0}

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
	goAwaySent  bool
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

type hpackSink struct{ b *bytes.Buffer }

func (h *hpackSink) Write(p []byte) (int, error) { return h.b.Write(p) }

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

func (c *conn) newReadFramer() *http2.Framer {
	fr := http2.NewFramer(nil, c.nc)
	fr.SetMaxReadFrameSize(maxFrameSize)
	fr.ReadMetaHeaders = c.hdec
	fr.MaxHeaderListSize = c.srv.maxHeaderList()
	return fr
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

func (c *conn) serveFrames() {
	s := c.srv
	var err error
	defer func() {
		c.closeWith(err)
		c.mu.Lock()
		if c.timer != nil {
			c.timer.Stop()
		}
		c.mu.Unlock()
		s.removeConn(c)
		s.serving.Done()
	}()
	rht := orDefault(s.ReadHeaderTimeout, DefaultReadHeaderTimeout)
	_ = c.nc.SetDeadline(time.Now().Add(rht))
	var preface [len(http2.ClientPreface)]byte
	if _, err = io.ReadFull(c.nc, preface[:]); err != nil {
		err = fmt.Errorf("h2serve: read client preface: %w", err)
		s.Logger.Debug("h2serve: preface", "remote", c.remoteAddr, "err", err)
		return
	}
	if string(preface[:]) != http2.ClientPreface {
		err = errors.New("h2serve: bad client preface (HTTP/1 is not served)")
		s.Logger.Debug("h2serve: preface", "remote", c.remoteAddr, "err", err)
		return
	}
	// Until the peer acknowledges our SETTINGS it may use the default
	// 4 KiB HPACK table.
	c.hdec = hpack.NewDecoder(4096, nil)
	c.fr = c.newReadFramer()
	err = c.writeFrames(func(fr *http2.Framer) error {
		if err := fr.WriteSettings(
			http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: s.maxStreams()},
			http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: s.maxHeaderList()},
			http2.Setting{ID: http2.SettingHeaderTableSize, Val: s.headerTable()},
			http2.Setting{ID: http2.SettingEnablePush, Val: 0},
		); err != nil {
			return err
		}
		return fr.WriteWindowUpdate(0, connWindow-65535)
	})
	if err != nil {
		return
	}
	c.mu.Lock()
	c.recvWindow = connWindow
	c.settingsOut = true
	goAway := c.goAwaySent
	c.goAwaySent = false
	c.mu.Unlock()
	if goAway { // Shutdown came during the preface
		c.startGoAway()
	}

	f, err := c.fr.ReadFrame()
	if err != nil {
		err = c.readError(err)
		return
	}
	sf, ok := f.(*http2.SettingsFrame)
	if !ok || sf.IsAck() {
		err = c.fail(connError{http2.ErrCodeProtocol, "first frame is not SETTINGS"})
		return
	}
	if err = c.handleFrame(f); err != nil {
		err = c.fail(err)
		return
	}
	_ = c.nc.SetDeadline(time.Time{})
	c.touch()
	c.startTimer()

	for {
		f, err = c.fr.ReadFrame()
		if err != nil {
			// The framer read the whole frame (and decoded the whole
			// header block): a stream error leaves the connection usable.
			var se http2.StreamError
			if errors.As(err, &se) && se.StreamID%2 == 1 {
				c.streamError(se.StreamID, se.Code)
				err = nil
				continue
			}
			err = c.readError(err)
			return
		}
		c.touch()
		large := f.Header().Length > 1024
		if err = c.handleFrame(f); err != nil {
			if se, ok := err.(http2.StreamError); ok {
				c.streamError(se.StreamID, se.Code)
				err = nil
				continue
			}
			err = c.fail(err)
			return
		}
		if large {
			// Drop the framer's read buffer (it keeps its largest frame).
			c.fr = c.newReadFramer()
		}
	}
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

func (c *conn) touch() { c.lastRead.Store(time.Now().UnixNano()) }

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

func (c *conn) handleFrame(f http2.Frame) error {
	switch f := f.(type) {
	case *http2.MetaHeadersFrame:
		return c.handleHeaders(f)
	case *http2.DataFrame:
		return c.handleData(f)
	case *http2.SettingsFrame:
		return c.handleSettings(f)
	case *http2.PingFrame:
		if f.IsAck() {
			if f.Data == pingPayload {
				c.pingSent.Store(0)
			}
			return nil
		}
		return c.writeFrames(func(fr *http2.Framer) error { return fr.WritePing(true, f.Data) })
	case *http2.WindowUpdateFrame:
		return c.handleWindowUpdate(f)
	case *http2.RSTStreamFrame:
		c.mu.Lock()
		if f.StreamID > c.maxSeen {
			c.mu.Unlock()
			return connError{http2.ErrCodeProtocol, "RST_STREAM on an idle stream"}
		}
		s := c.findLocked(f.StreamID)
		c.mu.Unlock()
		if s != nil {
			c.resetStream(s, f.ErrCode, fmt.Errorf("%w (%s)", errStreamReset, f.ErrCode), false)
		}
		return nil
	case *http2.GoAwayFrame:
		c.mu.Lock()
		c.peerGoAway = true
		idle := c.handlers == 0
		c.mu.Unlock()
		if f.ErrCode != http2.ErrCodeNo {
			c.srv.Logger.Debug("h2serve: peer sent GOAWAY", "remote", c.remoteAddr, "code", f.ErrCode, "debug", string(f.DebugData()))
		}
		if idle {
			c.closeGraceful()
		}
		return nil
	case *http2.PushPromiseFrame:
		return connError{http2.ErrCodeProtocol, "PUSH_PROMISE from a client"}
	case *http2.ContinuationFrame:
		return connError{http2.ErrCodeProtocol, "unexpected CONTINUATION"}
	case *http2.PriorityFrame:
		// Read and ignored, but a stream cannot depend on itself
		// (RFC 9113 section 5.3.1).
		if f.StreamDep == f.StreamID {
			return http2.StreamError{StreamID: f.StreamID, Code: http2.ErrCodeProtocol}
		}
		return nil
	default: // unknown frames are ignored
		return nil
	}
}

func (c *conn) handleSettings(f *http2.SettingsFrame) error {
	if f.IsAck() {
		// The peer now encodes with our small table: its encoder has
		// already evicted down to it (RFC 7541 section 4.2), so ours may too.
		// Without a dynamic table a fresh decoder is an exact mirror and
		// drops what the first request's headers left in the old one.
		if size := c.srv.headerTable(); size == 0 {
			c.hdec = hpack.NewDecoder(0, nil)
			c.fr.ReadMetaHeaders = c.hdec
		} else {
			c.hdec.SetMaxDynamicTableSize(size)
			c.hdec.SetAllowedMaxDynamicTableSize(size)
		}
		return nil
	}
	if f.StreamID != 0 {
		return connError{http2.ErrCodeProtocol, "SETTINGS on a stream"}
	}
	err := f.ForeachSetting(func(st http2.Setting) error {
		if err := st.Valid(); err != nil {
			var ce http2.ConnectionError
			if errors.As(err, &ce) {
				return connError{http2.ErrCode(ce), "invalid setting " + st.String()}
			}
			return connError{http2.ErrCodeProtocol, "invalid setting " + st.String()}
		}
		switch st.ID {
		case http2.SettingHeaderTableSize:
			c.wmu.Lock()
			if c.henc != nil {
				c.henc.SetMaxDynamicTableSize(st.Val)
			}
			c.wmu.Unlock()
		case http2.SettingInitialWindowSize:
			c.mu.Lock()
			defer c.mu.Unlock()
			delta := int64(st.Val) - int64(c.peerInit)
			for _, s := range c.streams {
				if int64(s.sendWindow)+delta > math.MaxInt32 {
					return connError{http2.ErrCodeFlowControl, "SETTINGS_INITIAL_WINDOW_SIZE overflows a stream window"}
				}
				s.sendWindow += int32(delta)
			}
			c.peerInit = int32(st.Val)
			c.broadcastLocked()
		}
		return nil
	})
	if err != nil {
		return err
	}
	return c.writeFrames(func(fr *http2.Framer) error { return fr.WriteSettingsAck() })
}

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

func (c *conn) handleData(f *http2.DataFrame) error {
	id, n := f.StreamID, int32(f.Length)
	c.mu.Lock()
	if n > c.recvWindow {
		c.mu.Unlock()
		return connError{http2.ErrCodeFlowControl, "DATA beyond the connection window"}
	}
	c.recvWindow -= n
	if id > c.maxSeen {
		c.mu.Unlock()
		return connError{http2.ErrCodeProtocol, "DATA on an idle stream"}
	}
	s := c.findLocked(id)
	if s == nil || s.remoteClosed {
		c.mu.Unlock()
		c.credit(nil, int(n))
		return http2.StreamError{StreamID: id, Code: http2.ErrCodeStreamClosed}
	}
	if n > s.recvWindow {
		c.mu.Unlock()
		c.credit(nil, int(n))
		return http2.StreamError{StreamID: id, Code: http2.ErrCodeFlowControl}
	}
	s.recvWindow -= n
	data := f.Data()
	end := f.StreamEnded()
	if s.bodyLeft >= 0 {
		// A body that disagrees with its content-length is malformed
		// (RFC 9113 section 8.1.1): more DATA than announced, or fewer by
		// END_STREAM.
		s.bodyLeft -= int64(len(data))
		if s.bodyLeft < 0 || (end && s.bodyLeft > 0) {
			c.mu.Unlock()
			c.credit(nil, int(n))
			return http2.StreamError{StreamID: id, Code: http2.ErrCodeProtocol}
		}
	}
	if end {
		s.remoteClosed = true
	}
	c.mu.Unlock()
	if pad := int(n) - len(data); pad > 0 {
		c.credit(s, pad)
	}
	if len(data) > 0 || end {
		s.body.push(data, end)
	}
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

func (c *conn) handleHeaders(f *http2.MetaHeadersFrame) error {
	id := f.StreamID
	if id%2 == 0 {
		return connError{http2.ErrCodeProtocol, "HEADERS on an even stream id"}
	}
	srv := c.srv
	c.mu.Lock()
	if s := c.findLocked(id); s != nil { // request trailers
		if s.remoteClosed {
			// HEADERS after END_STREAM: a stream error while our response
			// is still being sent, a connection error once it is done
			// (RFC 9113 section 5.1); the handler may not have returned
			// yet when the peer has read our END_STREAM, so it is a
			// connection error either way (section 5.4.1 allows that).
			c.mu.Unlock()
			return connError{http2.ErrCodeStreamClosed, "HEADERS after END_STREAM"}
		}
		if !f.StreamEnded() {
			c.mu.Unlock()
			return http2.StreamError{StreamID: id, Code: http2.ErrCodeProtocol}
		}
		if s.bodyLeft > 0 { // trailers end a body shorter than its content-length
			c.mu.Unlock()
			return http2.StreamError{StreamID: id, Code: http2.ErrCodeProtocol}
		}
		s.remoteClosed = true
		c.mu.Unlock()
		s.body.push(nil, true)
		return nil
	}
	if id <= c.maxSeen {
		// A closed stream: HEADERS after the peer's END_STREAM are a
		// connection error (RFC 9113 section 5.1), but trailers in flight
		// for a stream we cut short only reset it, so they do not end the
		// connection's other streams.
		short := slices.Contains(c.cutShort[:], id)
		c.mu.Unlock()
		if short {
			return http2.StreamError{StreamID: id, Code: http2.ErrCodeStreamClosed}
		}
		return connError{http2.ErrCodeStreamClosed, "HEADERS on a closed stream"}
	}
	c.maxSeen = id
	if f.HasPriority() && f.Priority.StreamDep == id {
		c.mu.Unlock()
		return http2.StreamError{StreamID: id, Code: http2.ErrCodeProtocol}
	}
	// The limit counts open streams, as the peer does; a reset stream's
	// handler may still be finishing, so running handlers get a looser
	// bound (against rapid-reset floods).
	if c.goAwaySent || c.closing || c.closed || len(c.streams) >= int(srv.maxStreams()) || c.handlers >= 4*int(srv.maxStreams()) {
		c.mu.Unlock()
		return http2.StreamError{StreamID: id, Code: http2.ErrCodeRefusedStream}
	}
	// Counted from here: an idle check (Shutdown, a GOAWAY) must not close
	// the connection under a stream it has accepted.
	c.handlers++
	c.idleSince = time.Time{}
	c.mu.Unlock()

	if f.Truncated {
		err := c.refuseHeaders(id, f.StreamEnded())
		c.unreserve(id)
		return err
	}
	r, err := c.newRequest(f)
	if err != nil {
		srv.Logger.Debug("h2serve: bad request headers", "remote", c.remoteAddr, "err", err)
		_ = c.writeFrames(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, http2.ErrCodeProtocol) })
		c.unreserve(id)
		return nil
	}
	s := &stream{c: c, id: id, recvWindow: streamWindow, bodyLeft: r.ContentLength}
	s.body.s = s
	s.rw.s = s
	// Not a child of a connection context: closeWith cancels each stream,
	// and a parent would keep a map of its children per connection.
	ctx, cancel := context.WithCancelCause(c.base)
	s.cancel = cancel
	if f.StreamEnded() {
		s.remoteClosed = true
		s.body.eof = true
		r.ContentLength = 0
		s.bodyLeft = -1
	}
	r.Body = &s.body
	r = r.WithContext(ctx)

	c.mu.Lock()
	if c.closed { // closeWith, run meanwhile, could not cancel it
		c.mu.Unlock()
		cancel(errConnClosed)
		c.unreserve(id)
		return nil
	}
	s.sendWindow = c.peerInit
	c.streams = append(c.streams, s)
	c.mu.Unlock()
	srv.streamsWG.Add(1)
	srv.handlers.Add(1)
	go c.runHandler(s, r)
	return nil
}

// cutShortLocked remembers that stream id was closed before the peer ended
// it (a few ids per connection, the most recent).
func (c *conn) cutShortLocked(id uint32) {
	c.cutShort[c.cutShortNext%uint8(len(c.cutShort))] = id
	c.cutShortNext++
}

// unreserve gives back the handler slot handleHeaders took for a stream
// that is not served after all.
func (c *conn) unreserve(id uint32) {
	c.mu.Lock()
	c.cutShortLocked(id)
	c.handlers--
	idle := c.handlers == 0
	if idle {
		c.idleSince = time.Now()
	}
	closeNow := idle && (c.goAwaySent || c.peerGoAway)
	c.mu.Unlock()
	if closeNow {
		c.closeGraceful()
	}
}

// refuseHeaders answers a request whose header list is too large with 431.
func (c *conn) refuseHeaders(id uint32, ended bool) error {
	return c.writeFrames(func(fr *http2.Framer) error {
		if err := c.writeHeaderBlock(fr, id, http.StatusRequestHeaderFieldsTooLarge, nil, false, true); err != nil {
			return err
		}
		if !ended {
			return fr.WriteRSTStream(id, http2.ErrCodeNo)
		}
		return nil
	})
}

func (c *conn) newRequest(f *http2.MetaHeadersFrame) (*http.Request, error) {
	method, path := f.PseudoValue("method"), f.PseudoValue("path")
	scheme, authority := f.PseudoValue("scheme"), f.PseudoValue("authority")
	if method == "" || path == "" || scheme == "" {
		return nil, errors.New("missing :method, :path or :scheme (CONNECT is not served)")
	}
	if f.PseudoValue("status") != "" || f.PseudoValue("protocol") != "" {
		return nil, errors.New("unexpected pseudo header")
	}
	u, err := url.ParseRequestURI(path)
	if err != nil {
		return nil, fmt.Errorf("bad :path: %w", err)
	}
	regular := f.RegularFields()
	h := make(http.Header, len(regular))
	for _, hf := range regular {
		switch hf.Name {
		case "connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade":
			return nil, fmt.Errorf("connection-specific header %q", hf.Name)
		case "te":
			if hf.Value != "trailers" {
				return nil, errors.New(`"te" other than "trailers"`)
			}
		}
		k := http.CanonicalHeaderKey(hf.Name)
		h[k] = append(h[k], hf.Value)
	}
	if authority == "" {
		authority = h.Get("Host")
	}
	cl := int64(-1)
	if v := h.Get("Content-Length"); v != "" {
		if n, err := strconv.ParseInt(v, 10, 64); err == nil && n >= 0 {
			cl = n
		}
	}
	return &http.Request{
		Method: method, URL: u, Proto: "HTTP/2.0", ProtoMajor: 2, Header: h, ContentLength: cl,
		Host: authority, RemoteAddr: c.remoteAddr, RequestURI: path, TLS: c.tlsState,
	}, nil
}

func (c *conn) runHandler(s *stream, r *http.Request) {
	srv := c.srv
	path := r.URL.Path // the request itself is not kept past ServeHTTP's use of it
	panicked := true
	defer func() {
		if panicked {
			if v := recover(); v != nil && v != http.ErrAbortHandler { //nolint:errorlint // sentinel panic value
				buf := make([]byte, 16<<10)
				buf = buf[:runtime.Stack(buf, false)]
				srv.Logger.Error("h2serve: handler panicked", "path", path, "panic", v, "stack", string(buf))
			}
			c.resetStream(s, http2.ErrCodeInternal, errHandlerPanic, true)
			s.rw.release()
		} else {
			s.rw.finish()
		}
		s.body.closeHandler()
		s.cancel(errStreamDone)
		c.streamDone(s)
		srv.streamsWG.Add(-1)
		srv.handlers.Done()
	}()
	srv.Handler.ServeHTTP(&s.rw, r)
	panicked = false
}

// streamDone forgets a stream whose handler returned; a peer still
// sending is told to stop with RST_STREAM(NO_ERROR).
func (c *conn) streamDone(s *stream) {
	c.mu.Lock()
	c.handlers--
	rst := !s.reset && !s.remoteClosed
	if rst {
		c.cutShortLocked(s.id)
	}
	s.reset = true
	c.removeLocked(s)
	idle := c.handlers == 0
	if idle {
		c.idleSince = time.Now()
	}
	closeNow := idle && (c.goAwaySent || c.peerGoAway)
	c.broadcastLocked()
	c.mu.Unlock()
	if rst {
		_ = c.writeFrames(func(fr *http2.Framer) error { return fr.WriteRSTStream(s.id, http2.ErrCodeNo) })
	}
	if closeNow {
		c.closeGraceful()
	}
}

// resetStream ends a stream early: its context is cancelled, its body
// fails, its writers stop; send says whether to send RST_STREAM(code).
func (c *conn) resetStream(s *stream, code http2.ErrCode, err error, send bool) {
	c.mu.Lock()
	if s.reset {
		c.mu.Unlock()
		return
	}
	s.reset = true
	s.resetErr = err
	if !s.remoteClosed {
		c.cutShortLocked(s.id)
	}
	c.removeLocked(s)
	c.broadcastLocked()
	c.mu.Unlock()
	s.cancel(err)
	s.body.fail(err)
	if send {
		_ = c.writeFrames(func(fr *http2.Framer) error { return fr.WriteRSTStream(s.id, code) })
	}
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

// streamResetErr is why s may send no more frames (nil: it may). The
// caller may hold wmu.
func (c *conn) streamResetErr(s *stream) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return s.resetErr
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

// frameWriter is a pooled bufio.Writer and framer over it, and a buffer for
// HPACK output: taken by one write and put back.
type frameWriter struct {
	bw *bufio.Writer
	fr *http2.Framer
	hb bytes.Buffer
}

var frameWriterPool = sync.Pool{New: func() any {
	w := &frameWriter{bw: bufio.NewWriterSize(nil, 4<<10)}
	w.fr = http2.NewFramer(w.bw, nil)
	return w
}}

// writeFrames runs fn with a framer writing to the connection, under the
// write mutex, and flushes. A failed write closes the connection.
func (c *conn) writeFrames(fn func(fr *http2.Framer) error) error {
	c.wmu.Lock()
	if c.werr != nil {
		err := c.werr
		c.wmu.Unlock()
		return err
	}
	w := frameWriterPool.Get().(*frameWriter)
	w.bw.Reset(c.nc)
	c.hsink.b = &w.hb
	_ = c.nc.SetWriteDeadline(time.Now().Add(orDefault(c.srv.WriteTimeout, DefaultWriteTimeout)))
	err := fn(w.fr)
	if err == nil {
		err = w.bw.Flush()
	}
	c.hsink.b = nil
	w.bw.Reset(nil)
	if w.hb.Cap() > 64<<10 {
		w.hb = bytes.Buffer{}
	}
	w.hb.Reset()
	frameWriterPool.Put(w)
	if err != nil {
		err = fmt.Errorf("h2serve: write: %w", err)
		c.werr = err
	}
	c.wmu.Unlock()
	if err != nil {
		c.closeWith(err)
	}
	return err
}

// statelessEncoder never adds to its dynamic table (limit 0), so it
// carries no state between header blocks and any connection may use any
// of them: connections without a table keep no encoder of their own.
type statelessEncoder struct {
	enc  *hpack.Encoder
	sink hpackSink
}

var statelessEncoders = sync.Pool{New: func() any {
	se := &statelessEncoder{}
	se.enc = hpack.NewEncoder(&se.sink)
	se.enc.SetMaxDynamicTableSizeLimit(0)
	return se
}}

var hopByHop = map[string]bool{
	"Connection": true, "Keep-Alive": true, "Proxy-Connection": true, "Transfer-Encoding": true, "Upgrade": true,
}

// writeHeaderBlock HPACK-encodes a response header (status > 0) or a
// trailer block and writes it as HEADERS and CONTINUATION frames. The
// caller holds wmu (inside writeFrames).
func (c *conn) writeHeaderBlock(fr *http2.Framer, id uint32, status int, h http.Header, stripPrefix bool, end bool) error {
	b := c.hsink.b
	b.Reset()
	enc := c.henc
	if enc == nil {
		se := statelessEncoders.Get().(*statelessEncoder)
		se.sink.b = b
		defer func() {
			se.sink.b = nil
			statelessEncoders.Put(se)
		}()
		enc = se.enc
	}
	if status > 0 {
		if err := enc.WriteField(hpack.HeaderField{Name: ":status", Value: strconv.Itoa(status)}); err != nil {
			return err
		}
	}
	for k, vv := range h {
		if hopByHop[k] {
			continue
		}
		if stripPrefix {
			k = strings.TrimPrefix(k, http.TrailerPrefix)
		}
		name := strings.ToLower(k)
		for _, v := range vv {
			if err := enc.WriteField(hpack.HeaderField{Name: name, Value: v}); err != nil {
				return err
			}
		}
	}
	block := b.Bytes()
	first := true
	for first || len(block) > 0 {
		n := min(len(block), maxFrameSize)
		frag := block[:n]
		block = block[n:]
		var err error
		if first {
			err = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: frag, EndStream: end, EndHeaders: len(block) == 0})
			first = false
		} else {
			err = fr.WriteContinuation(id, len(block) == 0, frag)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

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
	idle := c.handlers == 0
	c.mu.Unlock()
	_ = c.writeFrames(func(fr *http2.Framer) error { return fr.WriteGoAway(last, http2.ErrCodeNo, nil) })
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
