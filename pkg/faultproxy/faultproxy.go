// Package faultproxy is a TCP proxy for fault-injection tests: it forwards
// connections to a target and can add latency, blackhole traffic (keep the
// connections open but forward nothing, like a vanished host that sends no
// RST), cut every connection, or refuse new ones.
//
// It is written by hand because no maintained Go library offers a small
// in-process proxy with these faults; toxiproxy needs its own server.
package faultproxy

import (
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Proxy forwards TCP connections from Addr to a target, or to the first of
// several targets that accepts (a minimal L4 balancer with fail-over).
type Proxy struct {
	ln      net.Listener
	targets []string

	refuse    atomic.Bool
	refused   atomic.Int64 // connections closed at once while refusing
	blackhole atomic.Bool
	latency   atomic.Int64 // nanoseconds added to each forwarded chunk

	mu    sync.Mutex
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
	done  chan struct{}
}

// New starts a proxy on a free loopback port forwarding to target.
func New(target string) (*Proxy, error) { return NewBalancer(target) }

// NewBalancer starts a proxy that sends each connection to the first of
// targets that accepts it, so clients fail over when a target dies.
func NewBalancer(targets ...string) (*Proxy, error) {
	if len(targets) == 0 {
		return nil, errors.New("faultproxy: no target")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, targets: targets, conns: map[net.Conn]struct{}{}, done: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's listening address.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Port is the proxy's listening port.
func (p *Proxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

// SetLatency delays every forwarded chunk by d (0 removes it).
func (p *Proxy) SetLatency(d time.Duration) { p.latency.Store(int64(d)) }

// Blackhole stops forwarding in both directions while keeping every
// connection open (half-open peers see silence, not a reset); new
// connections are accepted and then hang too. Restore undoes it.
func (p *Proxy) Blackhole() { p.blackhole.Store(true) }

// Refuse closes new connections at once (the host is down).
func (p *Proxy) Refuse() { p.refuse.Store(true) }

// Refused counts the connections Refuse has closed since the proxy
// started: a test waits on it to see a client's attempts fail.
func (p *Proxy) Refused() int64 { return p.refused.Load() }

// Restore clears blackhole, refusal and latency.
func (p *Proxy) Restore() {
	p.blackhole.Store(false)
	p.refuse.Store(false)
	p.latency.Store(0)
}

// CutAll closes every open connection (peers see the connection drop).
func (p *Proxy) CutAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		_ = c.Close()
	}
}

// Close stops the proxy and closes every connection.
func (p *Proxy) Close() error {
	close(p.done)
	err := p.ln.Close()
	p.CutAll()
	p.wg.Wait()
	return err
}

func (p *Proxy) track(c net.Conn, add bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if add {
		p.conns[c] = struct{}{}
	} else {
		delete(p.conns, c)
	}
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		if p.refuse.Load() {
			_ = c.Close()
			p.refused.Add(1)
			continue
		}
		p.wg.Add(1)
		go p.serve(c)
	}
}

func (p *Proxy) serve(client net.Conn) {
	defer p.wg.Done()
	var server net.Conn
	var err error
	for _, t := range p.targets {
		if server, err = net.DialTimeout("tcp", t, time.Second); err == nil {
			break
		}
	}
	if server == nil {
		_ = client.Close()
		return
	}
	p.track(client, true)
	p.track(server, true)
	defer func() {
		p.track(client, false)
		p.track(server, false)
	}()
	var once sync.Once
	closeBoth := func() { once.Do(func() { _ = client.Close(); _ = server.Close() }) }
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); p.pipe(server, client); closeBoth() }()
	go func() { defer wg.Done(); p.pipe(client, server); closeBoth() }()
	wg.Wait()
}

func (p *Proxy) pipe(dst, src net.Conn) {
	buf := make([]byte, 32*1024)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			for p.blackhole.Load() {
				select {
				case <-p.done:
					return
				case <-time.After(10 * time.Millisecond):
				}
			}
			if d := time.Duration(p.latency.Load()); d > 0 {
				time.Sleep(d)
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return // EOF or a closed connection: both ends close
		}
	}
}

// URL is the proxy's address as an h2c base URL.
func (p *Proxy) URL() string { return "http://" + p.Addr() }
