// Package h2serve is a lean HTTP/2 server for many long-lived, mostly idle
// streams: the gateway's node sessions (docs/design.md#gateways).
//
// It is hand-written because no well-kept library serves HTTP/2 with fewer
// than three goroutines per connection: net/http (and golang.org/x/net/http2)
// keep serverConn.serve, readFrames and the handler per connection, plus
// per-connection buffers. Here one goroutine per connection reads frames and
// each stream's http.Handler runs in its own goroutine, so an idle
// single-stream connection costs two goroutines. There is no writer
// goroutine: whoever writes (a handler, or the reader answering a PING)
// writes under the connection's write mutex, through a bufio.Writer and a
// framer taken from a sync.Pool only for that write. Received DATA is kept
// in pooled buffers only while unread, and the HPACK tables are small.
//
// Frames are parsed and written with golang.org/x/net/http2's Framer and
// HPACK with golang.org/x/net/http2/hpack.
//
// Served: h2c with prior knowledge, and TLS with ALPN "h2" (r.TLS is set);
// SETTINGS, PING, flow control on both sides (a writer blocked on flow
// control gives up after WriteTimeout and resets its stream), at most
// MaxConcurrentStreams handlers per connection (REFUSED_STREAM past it),
// a header list limit (431), CONTINUATION, RST_STREAM (cancels the request
// context), GOAWAY, response trailers (the Trailer header and
// http.TrailerPrefix), http.Flusher, keepalive PINGs from a timer (no
// goroutine while waiting), graceful Shutdown and Close.
//
// Not served: HTTP/1.x (including the h2c upgrade), server push, stream
// priorities (PRIORITY frames are read and ignored), and request trailers
// (read and dropped).
package h2serve

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of the Server's zero fields.
const (
	DefaultMaxConcurrentStreams = 16
	DefaultMaxHeaderListSize    = 64 << 10
	DefaultReadHeaderTimeout    = 10 * time.Second
	DefaultWriteTimeout         = 30 * time.Second
	DefaultPingInterval         = 15 * time.Second
	DefaultPingTimeout          = 5 * time.Second

	// maxFrameSize is the largest frame read or written (the HTTP/2
	// minimum, so buffers stay small).
	maxFrameSize = 16 << 10
	// streamWindow is each stream's receive window (the HTTP/2 default).
	streamWindow = 65535
	// connWindow is the connection's receive window.
	connWindow = 1 << 20
)

// ErrServerClosed is returned by Serve after Shutdown or Close.
var ErrServerClosed = http.ErrServerClosed

// Server serves HTTP/2 connections. Set its fields before Serve.
type Server struct {
	// Handler serves every request.
	Handler http.Handler
	// TLSConfig, when set, makes Serve run TLS on accepted connections
	// and require ALPN "h2"; otherwise Serve speaks h2c (prior knowledge).
	TLSConfig *tls.Config
	// MaxConcurrentStreams bounds the open streams of one connection
	// (0: 16); streams past it are refused with REFUSED_STREAM, and so are
	// streams while 4 times as many handlers still run (reset streams'
	// handlers finishing).
	MaxConcurrentStreams uint32
	// MaxHeaderListSize bounds a request's header list (0: 64 KiB);
	// larger requests get 431.
	MaxHeaderListSize uint32
	// HeaderTableSize is the HPACK dynamic table size of both directions:
	// the SETTINGS_HEADER_TABLE_SIZE advertised, and the cap of the
	// response encoder's table. The default, 0, keeps no dynamic table at
	// all once the client has acknowledged it: each long-lived connection
	// then holds no HPACK entries (a client's first request, sent before it
	// saw our SETTINGS, may still use the 4 KiB default table; that table is
	// dropped at the acknowledgement). Streams are long-lived, so re-sending
	// header names costs little.
	HeaderTableSize uint32
	// ReadHeaderTimeout bounds the TLS handshake and the client preface
	// with its SETTINGS (0: 10 s).
	ReadHeaderTimeout time.Duration
	// WriteTimeout bounds one write to the connection and the wait for
	// flow-control credit (0: 30 s). A connection write that times out
	// closes the connection; a flow-control wait resets the stream.
	WriteTimeout time.Duration
	// PingInterval: a connection that received nothing for this long is
	// PINGed (0: 15 s; negative: never); PingTimeout: without the ack
	// within this long it is closed (0: 5 s).
	PingInterval, PingTimeout time.Duration
	// IdleTimeout closes a connection without streams for this long
	// (0: never).
	IdleTimeout time.Duration
	// BaseContext, when set, is the parent of every request context.
	BaseContext context.Context
	// Logger logs connection errors at debug level (nil: discard).
	Logger *slog.Logger

	mu        sync.Mutex
	listeners map[net.Listener]struct{}
	conns     map[*conn]struct{}
	closed    bool
	shutdown  atomic.Bool
	handlers  sync.WaitGroup
	serving   sync.WaitGroup // conn reader goroutines
	connGone  chan struct{}  // signalled (non-blocking) when a conn ends
	initOnce  sync.Once
	streamsWG atomic.Int64 // running handlers (for Shutdown)
}

func (s *Server) init() {
	s.initOnce.Do(func() {
		s.listeners = map[net.Listener]struct{}{}
		s.conns = map[*conn]struct{}{}
		s.connGone = make(chan struct{}, 1)
		if s.Logger == nil {
			s.Logger = slog.New(slog.DiscardHandler)
		}
	})
}

func (s *Server) maxStreams() uint32 {
	if s.MaxConcurrentStreams == 0 {
		return DefaultMaxConcurrentStreams
	}
	return s.MaxConcurrentStreams
}

func (s *Server) maxHeaderList() uint32 {
	if s.MaxHeaderListSize == 0 {
		return DefaultMaxHeaderListSize
	}
	return s.MaxHeaderListSize
}

func (s *Server) headerTable() uint32 { return s.HeaderTableSize }

func orDefault(d, def time.Duration) time.Duration {
	if d == 0 {
		return def
	}
	return d
}

// Serve accepts connections on ln until Shutdown or Close, and returns
// ErrServerClosed then; any other accept error is returned as is.
func (s *Server) Serve(ln net.Listener) error {
	s.init()
	s.mu.Lock()
	if s.closed || s.shutdown.Load() {
		s.mu.Unlock()
		_ = ln.Close()
		return ErrServerClosed
	}
	s.listeners[ln] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, ln)
		s.mu.Unlock()
	}()
	var backoff time.Duration
	for {
		nc, err := ln.Accept()
		if err != nil {
			if s.shutdown.Load() || s.isClosed() {
				return ErrServerClosed
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				s.Logger.Debug("h2serve: accept", "err", err, "retry_in", backoff)
				time.Sleep(backoff)
				continue
			}
			return fmt.Errorf("h2serve: accept: %w", err)
		}
		backoff = 0
		c := s.newConn(nc)
		s.mu.Lock()
		if s.closed || s.shutdown.Load() {
			s.mu.Unlock()
			_ = nc.Close()
			return ErrServerClosed
		}
		s.conns[c] = struct{}{}
		s.serving.Add(1)
		s.mu.Unlock()
		go c.serve()
	}
}

func (s *Server) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

func (s *Server) removeConn(c *conn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
	select {
	case s.connGone <- struct{}{}:
	default:
	}
}

func (s *Server) closeListeners() {
	for ln := range s.listeners {
		_ = ln.Close()
	}
}

// Shutdown stops accepting, sends every connection GOAWAY, waits for the
// running handlers to return and closes the connections as they empty. It
// returns ctx's error if ctx ends first (the rest are left to Close).
func (s *Server) Shutdown(ctx context.Context) error {
	s.init()
	s.shutdown.Store(true)
	s.mu.Lock()
	s.closeListeners()
	conns := s.snapshotLocked()
	s.mu.Unlock()
	for _, c := range conns {
		c.startGoAway()
	}
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		s.mu.Lock()
		conns := s.snapshotLocked()
		s.mu.Unlock()
		for _, c := range conns {
			c.closeIfIdle()
		}
		if len(conns) == 0 && s.streamsWG.Load() == 0 {
			s.serving.Wait()
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("h2serve: shutdown: %w", ctx.Err())
		case <-s.connGone:
		case <-t.C:
		}
	}
}

// Close closes the listeners and every connection at once (their
// handlers see their request contexts cancelled), then waits for the
// connections' reader goroutines. It does not wait for handlers.
func (s *Server) Close() error {
	s.init()
	s.mu.Lock()
	s.closed = true
	s.closeListeners()
	conns := s.snapshotLocked()
	s.mu.Unlock()
	for _, c := range conns {
		c.closeWith(errServerClosed)
	}
	s.serving.Wait()
	return nil
}

// Wait blocks until every handler has returned (tests use it after Close).
func (s *Server) Wait() { s.handlers.Wait() }

func (s *Server) snapshotLocked() []*conn {
	out := make([]*conn, 0, len(s.conns))
	for c := range s.conns {
		out = append(out, c)
	}
	return out
}

var errServerClosed = errors.New("h2serve: server closed")

// serveConn serves one already accepted connection (the fuzz target's
// entry) and returns when it is closed.
func (s *Server) serveConn(nc net.Conn) {
	s.init()
	c := s.newConn(nc)
	s.mu.Lock()
	s.conns[c] = struct{}{}
	s.serving.Add(1)
	s.mu.Unlock()
	c.serve()
}
