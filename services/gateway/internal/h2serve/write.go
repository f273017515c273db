package h2serve

// The write side: frames go out under wmu through a pooled buffered framer;
// header blocks are encoded with the connection's hpack encoder or a
// stateless one.

import (
	"bufio"
	"bytes"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

type hpackSink struct{ b *bytes.Buffer }

func (h *hpackSink) Write(p []byte) (int, error) { return h.b.Write(p) }

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
