package h2serve

// The reader side: the frame loop and one handler per frame type, which
// open streams, start their handlers and end them.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"runtime"
	"slices"
	"strconv"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

func (c *conn) newReadFramer() *http2.Framer {
	fr := http2.NewFramer(nil, c.nc)
	fr.SetMaxReadFrameSize(maxFrameSize)
	fr.ReadMetaHeaders = c.hdec
	fr.MaxHeaderListSize = c.srv.maxHeaderList()
	return fr
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
		// Closing with the client's bytes unread would reset the
		// connection; it must end (RFC 9113 section 3.4).
		c.linger()
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
			var se http2.StreamError
			if errors.As(err, &se) {
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
	closeNow := idle && (c.goAwayOut || c.peerGoAway)
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
	closeNow := idle && (c.goAwayOut || c.peerGoAway)
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

// streamResetErr is why s may send no more frames (nil: it may). The
// caller may hold wmu.
func (c *conn) streamResetErr(s *stream) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return s.resetErr
}
