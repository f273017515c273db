package h2serve

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync"

	"golang.org/x/net/http2"
)

// stream is one request. Fields after cancel are guarded by c.mu.
type stream struct {
	c      *conn
	id     uint32
	cancel context.CancelCauseFunc
	body   requestBody
	rw     responseWriter

	sendWindow   int32
	recvWindow   int32
	unacked      int32
	bodyLeft     int64 // DATA bytes the request's content-length still announces (-1: none declared)
	remoteClosed bool  // END_STREAM received
	reset        bool  // no longer open: reset, done, or connection closed
	resetErr     error // why writes fail (nil after a clean finish)
}

// bufPool holds frame-sized buffers for received and outgoing DATA.
var bufPool = sync.Pool{New: func() any {
	b := make([]byte, 0, maxFrameSize)
	return &b
}}

// closedCh is a closed channel: "readable now".
var closedCh = func() chan struct{} {
	ch := make(chan struct{})
	close(ch)
	return ch
}()

// requestBody is a request's body: DATA received and not yet read sits in
// a pooled buffer that is returned once drained.
type requestBody struct {
	s    *stream
	mu   sync.Mutex
	bp   *[]byte // pooled buffer, nil when nothing is buffered
	buf  []byte
	r    int
	eof  bool
	err  error
	shut bool // closed by the handler, or the handler returned
	wake chan struct{}
}

// WaitReadable returns a channel closed once Read would not block: data
// or the end of the body has arrived, the stream was reset, or the body
// was closed. The gateway waits on it beside its outbound queue.
func (b *requestBody) WaitReadable() <-chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.readableLocked() {
		return closedCh
	}
	return b.waitLocked()
}

func (b *requestBody) readableLocked() bool {
	return b.shut || b.r < len(b.buf) || b.err != nil || b.eof
}

func (b *requestBody) waitLocked() chan struct{} {
	if b.wake == nil {
		b.wake = make(chan struct{})
	}
	return b.wake
}

func (b *requestBody) signalLocked() {
	if b.wake != nil {
		close(b.wake)
		b.wake = nil
	}
}

func (b *requestBody) releaseLocked() {
	if b.bp != nil {
		*b.bp = (*b.bp)[:0]
		bufPool.Put(b.bp)
		b.bp = nil
	}
	b.buf, b.r = nil, 0
}

// dropLocked discards the unread data and wakes waiters; it returns how
// many bytes were dropped, which the caller must credit back to the
// connection window once b.mu is released.
func (b *requestBody) dropLocked() int {
	unread := len(b.buf) - b.r
	b.releaseLocked()
	b.signalLocked()
	return unread
}

// Read reads received DATA, waiting for it; it returns io.EOF at the end
// of the stream and an error once the stream is reset or the body closed.
func (b *requestBody) Read(p []byte) (int, error) {
	for {
		b.mu.Lock()
		if b.shut {
			b.mu.Unlock()
			return 0, errBodyClosed
		}
		if b.r < len(b.buf) {
			n := copy(p, b.buf[b.r:])
			b.r += n
			if b.r == len(b.buf) {
				b.releaseLocked()
			}
			b.mu.Unlock()
			b.s.c.credit(b.s, n)
			return n, nil
		}
		if b.err != nil {
			err := b.err
			b.mu.Unlock()
			return 0, err
		}
		if b.eof {
			b.mu.Unlock()
			return 0, io.EOF
		}
		if len(p) == 0 {
			b.mu.Unlock()
			return 0, nil
		}
		ch := b.waitLocked()
		b.mu.Unlock()
		<-ch
	}
}

// Close closes the body: a pending or later Read fails. Unread data is
// returned to the connection's window.
func (b *requestBody) Close() error {
	b.mu.Lock()
	if b.shut {
		b.mu.Unlock()
		return nil
	}
	b.shut = true
	unread := b.dropLocked()
	b.mu.Unlock()
	b.s.c.credit(nil, unread)
	return nil
}

func (b *requestBody) closeHandler() { _ = b.Close() }

// push appends DATA from the reader goroutine.
func (b *requestBody) push(data []byte, end bool) {
	b.mu.Lock()
	if b.shut || b.err != nil {
		b.mu.Unlock()
		b.s.c.credit(nil, len(data))
		return
	}
	if len(data) > 0 {
		if b.bp == nil {
			b.bp = bufPool.Get().(*[]byte)
			b.buf, b.r = (*b.bp)[:0], 0
		} else if b.r > 0 {
			n := copy(b.buf, b.buf[b.r:])
			b.buf, b.r = b.buf[:n], 0
		}
		b.buf = append(b.buf, data...)
	}
	if end {
		b.eof = true
	}
	b.signalLocked()
	b.mu.Unlock()
}

// fail makes Read return err once the buffered data is gone... or at once:
// a reset stream's data is dropped, and its bytes go back to the
// connection window.
func (b *requestBody) fail(err error) {
	b.mu.Lock()
	if b.err == nil {
		b.err = err
	}
	unread := b.dropLocked()
	b.mu.Unlock()
	b.s.c.credit(nil, unread)
}

// responseWriter is the stream's http.ResponseWriter. Like net/http's, it
// is for the handler's goroutine (or one at a time).
type responseWriter struct {
	s           *stream
	header      http.Header
	status      int
	wroteHeader bool        // status fixed
	sentHeader  bool        // HEADERS written
	snapshot    http.Header // the header as of WriteHeader, until sent
	declared    []string    // trailer keys declared in "Trailer"
	bp          *[]byte
	buf         []byte
	err         error
}

var (
	_ http.ResponseWriter = (*responseWriter)(nil)
	_ http.Flusher        = (*responseWriter)(nil)
)

// Header is the response header; keys prefixed with http.TrailerPrefix,
// and those declared in "Trailer", are sent as trailers.
func (w *responseWriter) Header() http.Header {
	if w.header == nil {
		w.header = make(http.Header)
	}
	return w.header
}

// WriteHeader fixes the status and the header.
func (w *responseWriter) WriteHeader(code int) {
	if w.wroteHeader || code < 200 || code > 999 {
		return // informational responses are not sent
	}
	w.wroteHeader, w.status = true, code
	h := w.header
	for _, v := range h["Trailer"] {
		for _, k := range strings.Split(v, ",") {
			if k = strings.TrimSpace(k); k != "" {
				w.declared = append(w.declared, http.CanonicalHeaderKey(k))
			}
		}
	}
	w.snapshot = make(http.Header, len(h))
	for k, vv := range h {
		if strings.HasPrefix(k, http.TrailerPrefix) || containsString(w.declared, k) {
			continue
		}
		w.snapshot[k] = vv[:len(vv):len(vv)]
	}
}

// Write buffers p and sends DATA frames as the buffer fills.
func (w *responseWriter) Write(p []byte) (int, error) {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if w.err != nil {
		return 0, w.err
	}
	written := 0
	for len(p) > 0 {
		if w.bp == nil {
			w.bp = bufPool.Get().(*[]byte)
			w.buf = (*w.bp)[:0]
		}
		n := min(len(p), maxFrameSize-len(w.buf))
		w.buf = append(w.buf, p[:n]...)
		p = p[n:]
		written += n
		if len(w.buf) >= maxFrameSize {
			if err := w.send(false, false); err != nil {
				return written - len(w.buf), err
			}
		}
	}
	return written, nil
}

// Flush sends the header and buffered data.
func (w *responseWriter) Flush() { _ = w.FlushError() }

// FlushError is Flush reporting a failed write (http.ResponseController).
func (w *responseWriter) FlushError() error {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if w.err != nil {
		return w.err
	}
	return w.send(false, false)
}

func (w *responseWriter) releaseBuf() {
	if w.bp != nil {
		*w.bp = (*w.bp)[:0]
		bufPool.Put(w.bp)
		w.bp, w.buf = nil, nil
	}
}

func (w *responseWriter) release() {
	w.releaseBuf()
	w.snapshot = nil
}

// send writes the header if not yet written, then the buffered data in
// frames the flow-control windows allow; end ends the stream on the last
// frame (headerEnd: on the HEADERS frame, nothing else to send).
func (w *responseWriter) send(end, headerEnd bool) error {
	s, c := w.s, w.s.c
	p := w.buf
	defer w.releaseBuf()
	if !w.sentHeader && len(p) > 0 && !c.hasSendCredit(s) {
		// HEADERS are not flow-controlled: do not hold them back while
		// the DATA waits for window.
		var gone error
		err := c.writeFrames(func(fr *http2.Framer) error {
			if gone = c.streamResetErr(s); gone != nil {
				return nil
			}
			return c.writeHeaderBlock(fr, s.id, w.status, w.snapshot, false, false)
		})
		if err == nil {
			err = gone
		}
		w.sentHeader, w.snapshot = true, nil
		if err != nil {
			w.err = err
			return err
		}
	}
	for {
		var chunk []byte
		if len(p) > 0 {
			n, err := c.takeSendCredit(s, len(p))
			if err != nil {
				w.err = err
				return err
			}
			chunk, p = p[:n], p[n:]
		}
		last := end && len(p) == 0
		sendHeader := !w.sentHeader
		if !sendHeader && len(chunk) == 0 && !last {
			return nil
		}
		var gone error
		err := c.writeFrames(func(fr *http2.Framer) error {
			// Checked under the write mutex: a reset's RST_STREAM is
			// written after resetErr is set, so nothing follows it.
			if gone = c.streamResetErr(s); gone != nil {
				return nil
			}
			if sendHeader {
				if err := c.writeHeaderBlock(fr, s.id, w.status, w.snapshot, false, headerEnd); err != nil {
					return err
				}
				if headerEnd {
					return nil
				}
			}
			if len(chunk) > 0 || last {
				return fr.WriteData(s.id, last, chunk)
			}
			return nil
		})
		if gone != nil && err == nil {
			c.returnConnCredit(len(chunk))
			err = gone
		}
		w.sentHeader, w.snapshot = true, nil
		if err != nil {
			w.err = err
			return err
		}
		if len(p) == 0 {
			return nil
		}
	}
}

// finish completes the response after the handler returned: header,
// data, and trailers (or END_STREAM on the last frame).
func (w *responseWriter) finish() {
	defer w.release()
	if w.err != nil {
		return
	}
	c := w.s.c
	c.mu.Lock()
	gone := w.s.reset
	c.mu.Unlock()
	if gone {
		return
	}
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	var trailers http.Header
	for _, k := range w.declared {
		if vv := w.header[k]; len(vv) > 0 {
			if trailers == nil {
				trailers = make(http.Header)
			}
			trailers[k] = vv
		}
	}
	for k, vv := range w.header {
		if strings.HasPrefix(k, http.TrailerPrefix) && len(vv) > 0 {
			if trailers == nil {
				trailers = make(http.Header)
			}
			trailers[k] = vv
		}
	}
	noTrailers := len(trailers) == 0
	if err := w.send(noTrailers, noTrailers && !w.sentHeader && len(w.buf) == 0); err != nil || noTrailers {
		return
	}
	_ = c.writeFrames(func(fr *http2.Framer) error {
		if c.streamResetErr(w.s) != nil {
			return nil
		}
		return c.writeHeaderBlock(fr, w.s.id, 0, trailers, true, true)
	})
}
