// Package tftp is the site agent's read-only TFTP server (RFC 1350, with
// the option extension of RFC 2347 and the blksize, timeout and tsize
// options of RFC 2348 and RFC 2349). Firmware PXE downloads its first boot
// file (the iPXE binary) from it.
//
// It is written here rather than taken from a library: github.com/pin/tftp,
// the maintained Go implementation, is not served by the module proxy this
// project builds from, and no other maintained Go TFTP server module is.
// Managing a tftpd-hpa process was the alternative; it was not chosen because
// the server must stop answering the instant the agent's boot grant lapses
// (the same self-fence as proxy DHCP), which an in-process gate checked on
// every request and every block gives exactly, and a child process restarted
// on role changes would not (docs/decisions.md, "Site boot: TFTP").
//
// Guarantees:
//   - read only: a write request gets "access violation" and nothing is
//     written;
//   - no path escape: absolute names, "..", backslashes and symlinks that
//     leave the root are refused (files are opened through os.Root);
//   - each transfer runs on its own UDP port (a socket connected to the
//     client), so a stray packet from another host never enters it;
//   - at most MaxTransfers run at once; a request beyond that gets "server
//     busy";
//   - a request, and every block of a transfer, is answered only while the
//     Gate says so; a transfer whose gate closes ends with an error packet.
package tftp

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Config configures the server.
type Config struct {
	// ListenAddr is the UDP address (0.0.0.0:69 on a site).
	ListenAddr string
	// Root is the directory served; nothing outside it is readable.
	Root string
	// MaxTransfers bounds concurrent transfers (64).
	MaxTransfers int
	// MaxBlockSize caps the blksize option (1468: a block in one
	// 1500-byte Ethernet frame).
	MaxBlockSize int
	// Timeout is the default retransmission timeout (1 s); a client may
	// ask for 1..255 s with the timeout option.
	Timeout time.Duration
	// Retries is how often a block is sent before the transfer is
	// abandoned (5).
	Retries int
}

// Validate checks the configuration.
func (c Config) Validate() error {
	var errs []error
	if _, err := net.ResolveUDPAddr("udp4", c.ListenAddr); err != nil || c.ListenAddr == "" {
		errs = append(errs, fmt.Errorf("--tftp.listen-addr %q is not a UDP address", c.ListenAddr))
	}
	if c.Root == "" {
		errs = append(errs, errors.New("--tftp.root is required"))
	}
	if c.MaxTransfers < 1 {
		errs = append(errs, fmt.Errorf("--tftp.max-transfers %d must be positive", c.MaxTransfers))
	}
	if c.MaxBlockSize < 512 || c.MaxBlockSize > 65464 {
		errs = append(errs, fmt.Errorf("--tftp.max-blksize %d must be 512..65464", c.MaxBlockSize))
	}
	if c.Timeout < 100*time.Millisecond || c.Timeout > 255*time.Second {
		errs = append(errs, fmt.Errorf("--tftp.timeout %s must be 100ms..255s", c.Timeout))
	}
	if c.Retries < 1 {
		errs = append(errs, fmt.Errorf("--tftp.retries %d must be positive", c.Retries))
	}
	return errors.Join(errs...)
}

// Gate says whether the server may answer now, and at which boot epoch.
type Gate func() (epoch uint64, ok bool)

// Server serves files from Config.Root.
type Server struct {
	cfg  Config
	gate Gate
	log  *slog.Logger
	m    *metrics

	root *os.Root
	conn *net.UDPConn
	sem  chan struct{}

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// New returns a server; call Listen, then Serve.
func New(cfg Config, gate Gate, log *slog.Logger, reg prometheus.Registerer) *Server {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Server{cfg: cfg, gate: gate, log: log, m: newMetrics(reg), sem: make(chan struct{}, max(cfg.MaxTransfers, 1)),
		ctx: ctx, cancel: cancel}
}

// Listen opens the root and the UDP socket.
func (s *Server) Listen() error {
	root, err := os.OpenRoot(s.cfg.Root)
	if err != nil {
		return fmt.Errorf("open --tftp.root: %w", err)
	}
	addr, err := net.ResolveUDPAddr("udp4", s.cfg.ListenAddr)
	if err != nil {
		_ = root.Close()
		return fmt.Errorf("--tftp.listen-addr %s: %w", s.cfg.ListenAddr, err)
	}
	conn, err := net.ListenUDP("udp4", addr)
	if err != nil {
		_ = root.Close()
		return fmt.Errorf("listen for TFTP on %s: %w", s.cfg.ListenAddr, err)
	}
	s.root, s.conn = root, conn
	return nil
}

// Addr is the bound address once listening.
func (s *Server) Addr() *net.UDPAddr {
	if s.conn == nil {
		return nil
	}
	return s.conn.LocalAddr().(*net.UDPAddr)
}

// Serve reads requests until Close and returns the socket's error (nil
// after Close).
func (s *Server) Serve() error {
	buf := make([]byte, 2048)
	for {
		n, peer, err := s.conn.ReadFromUDP(buf)
		if err != nil {
			if s.ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("read TFTP request: %w", err)
		}
		s.handle(append([]byte(nil), buf[:n]...), peer)
	}
}

// Close stops accepting requests, ends running transfers and waits for them.
func (s *Server) Close() error {
	s.cancel()
	var err error
	if s.conn != nil {
		err = s.conn.Close()
	}
	s.wg.Wait()
	if s.root != nil {
		_ = s.root.Close()
	}
	return err
}

// handle answers one packet that arrived on the listening port.
func (s *Server) handle(b []byte, peer *net.UDPAddr) {
	if len(b) > MaxRequestBytes {
		s.m.requests.WithLabelValues("malformed").Inc()
		s.log.Warn("TFTP request dropped: larger than 512 bytes", "client", peer.String(), "bytes", len(b))
		return
	}
	req, err := parseRequest(b)
	if err != nil {
		s.m.requests.WithLabelValues("malformed").Inc()
		s.log.Warn("TFTP packet dropped: malformed request", "client", peer.String(), "bytes", len(b), "err", err)
		return
	}
	epoch, ok := s.gate()
	if !ok {
		s.m.requests.WithLabelValues("standby").Inc()
		s.log.Debug("TFTP request dropped: not the active boot server", "client", peer.String(), "file", clip(req.filename))
		return
	}
	if req.op == opWRQ {
		s.m.requests.WithLabelValues("refused").Inc()
		s.log.Warn("TFTP write refused: the server is read-only", "client", peer.String(), "file", clip(req.filename))
		s.replyError(peer, errAccess, "read-only server: writes are not accepted")
		return
	}
	if req.mode != "octet" {
		s.m.requests.WithLabelValues("refused").Inc()
		s.log.Warn("TFTP request refused: only octet mode is served", "client", peer.String(), "file", clip(req.filename), "mode", clip(req.mode))
		s.replyError(peer, errIllegalOp, "only octet mode is served")
		return
	}
	f, size, err := s.open(req.filename)
	if err != nil {
		s.m.requests.WithLabelValues("refused").Inc()
		code := errFileNotFound
		if errors.Is(err, errOutsideRoot) {
			code = errAccess
		}
		s.log.Warn("TFTP request refused", "client", peer.String(), "file", clip(req.filename), "err", err)
		s.replyError(peer, code, err.Error())
		return
	}
	select {
	case s.sem <- struct{}{}:
	default:
		_ = f.Close()
		s.m.requests.WithLabelValues("busy").Inc()
		s.log.Warn("TFTP request refused: too many transfers", "client", peer.String(), "file", clip(req.filename), "max_transfers", s.cfg.MaxTransfers)
		s.replyError(peer, errNotDefined, "server busy: too many transfers, retry later")
		return
	}
	s.m.requests.WithLabelValues("accepted").Inc()
	s.m.inflight.Inc()
	s.wg.Add(1)
	go func() {
		defer func() { <-s.sem; s.m.inflight.Dec(); s.wg.Done() }()
		defer f.Close()
		s.transfer(req, f, size, peer, epoch)
	}()
}

// errOutsideRoot marks a name that would leave the root.
var errOutsideRoot = errors.New("path outside the TFTP root")

// open resolves name inside the root: a relative, local path of a regular
// file, never through a symlink that leaves the root.
func (s *Server) open(name string) (*os.File, int64, error) {
	switch {
	case name == "":
		return nil, 0, errors.New("empty file name")
	case strings.ContainsAny(name, "\\\x00"):
		return nil, 0, fmt.Errorf("%w: backslash or NUL in the name", errOutsideRoot)
	case strings.HasPrefix(name, "/"):
		return nil, 0, fmt.Errorf("%w: absolute name", errOutsideRoot)
	case !filepath.IsLocal(name):
		return nil, 0, fmt.Errorf("%w: name leaves the root", errOutsideRoot)
	}
	f, err := s.root.Open(name)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, 0, errors.New("file not found")
		}
		// os.Root refuses symlinks (and "..") leading out of the root.
		return nil, 0, fmt.Errorf("%w: %v", errOutsideRoot, stripRoot(err, s.cfg.Root))
	}
	st, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return nil, 0, errors.New("file not readable")
	}
	if !st.Mode().IsRegular() {
		_ = f.Close()
		return nil, 0, errors.New("not a regular file")
	}
	return f, st.Size(), nil
}

// stripRoot keeps the root's path out of messages sent to clients.
func stripRoot(err error, root string) string {
	return strings.ReplaceAll(err.Error(), root, "<root>")
}

// replyError sends one error packet from the listening port.
func (s *Server) replyError(peer *net.UDPAddr, code uint16, msg string) {
	if _, err := s.conn.WriteToUDP(errorPacket(code, msg), peer); err != nil {
		s.log.Debug("send TFTP error", "client", peer.String(), "err", err)
	}
}

// negotiate applies the client's options (RFC 2347-2349) and returns the
// block size, the retransmission timeout and the accepted options (empty:
// no OACK).
func (s *Server) negotiate(req request, size int64) (int, time.Duration, map[string]string) {
	blk, timeout := 512, s.cfg.Timeout
	acc := map[string]string{}
	if v, ok := req.options["blksize"]; ok {
		if n, ok := optionInt(v); ok && n >= 8 && n <= 65464 {
			blk = min(n, s.cfg.MaxBlockSize)
			acc["blksize"] = strconv.Itoa(blk)
		}
	}
	if v, ok := req.options["timeout"]; ok {
		if n, ok := optionInt(v); ok && n >= 1 && n <= 255 {
			timeout = time.Duration(n) * time.Second
			acc["timeout"] = strconv.Itoa(n)
		}
	}
	if v, ok := req.options["tsize"]; ok {
		if _, ok := optionInt(v); ok {
			acc["tsize"] = strconv.FormatInt(size, 10)
		}
	}
	return blk, timeout, acc
}

// transfer sends f to peer from a fresh port.
func (s *Server) transfer(req request, f *os.File, size int64, peer *net.UDPAddr, epoch uint64) {
	start := time.Now()
	local := &net.UDPAddr{IP: s.Addr().IP}
	conn, err := net.DialUDP("udp4", local, peer)
	if err != nil {
		s.log.Warn("TFTP transfer: open a transfer port", "client", peer.String(), "err", err)
		s.m.transfers.WithLabelValues("error").Inc()
		return
	}
	defer conn.Close()
	context.AfterFunc(s.ctx, func() { _ = conn.SetDeadline(time.Now()) })
	blk, timeout, acc := s.negotiate(req, size)
	log := s.log.With("client", peer.String(), "file", clip(req.filename), "blksize", blk, "epoch", epoch)
	t := &xfer{conn: conn, timeout: timeout, retries: s.cfg.Retries, gate: s.gate, ctx: s.ctx}
	if len(acc) > 0 {
		ok, err := t.exchange(oackPacket(req.order, acc), 0)
		if err != nil || !ok {
			// Clients often ask for tsize alone and abort after the OACK
			// (UEFI does): that is an ordinary end.
			s.m.transfers.WithLabelValues(outcome(err)).Inc()
			log.Info("TFTP transfer ended after option negotiation", "tsize", size, "reason", reason(err))
			return
		}
	}
	buf := make([]byte, blk)
	var sent int64
	for block := uint32(1); ; block++ {
		n, rerr := io.ReadFull(f, buf)
		if rerr != nil && !errors.Is(rerr, io.ErrUnexpectedEOF) && !errors.Is(rerr, io.EOF) {
			_, _ = conn.Write(errorPacket(errNotDefined, "read error"))
			s.m.transfers.WithLabelValues("error").Inc()
			log.Warn("TFTP transfer failed: read", "err", rerr)
			return
		}
		ok, err := t.exchange(dataPacket(uint16(block), buf[:n]), uint16(block))
		if err != nil || !ok {
			s.m.transfers.WithLabelValues(outcome(err)).Inc()
			log.Warn("TFTP transfer failed", "block", block, "bytes", sent, "reason", reason(err))
			return
		}
		sent += int64(n)
		s.m.bytes.Add(float64(n))
		if n < blk {
			break
		}
	}
	s.m.transfers.WithLabelValues("completed").Inc()
	log.Info("TFTP transfer completed", "bytes", sent, "took", time.Since(start).Round(time.Millisecond))
}

// xfer is one transfer's lock-step exchange.
type xfer struct {
	conn    *net.UDPConn
	timeout time.Duration
	retries int
	gate    Gate
	ctx     context.Context
	in      [1024]byte
}

var (
	errClientAbort = errors.New("client sent an error")
	errNoAck       = errors.New("no acknowledgement")
	errFenced      = errors.New("no longer the active boot server")
)

// exchange sends pkt until block is acknowledged: true on the ACK; an
// error when the client aborts, never answers or the gate closes.
func (t *xfer) exchange(pkt []byte, block uint16) (bool, error) {
	for try := 0; try < t.retries; try++ {
		if _, ok := t.gate(); !ok {
			_, _ = t.conn.Write(errorPacket(errNotDefined, "boot server is no longer active"))
			return false, errFenced
		}
		if _, err := t.conn.Write(pkt); err != nil {
			return false, fmt.Errorf("send: %w", err)
		}
		deadline := time.Now().Add(t.timeout)
		for {
			if t.ctx.Err() != nil {
				return false, t.ctx.Err()
			}
			_ = t.conn.SetReadDeadline(deadline)
			n, err := t.conn.Read(t.in[:])
			if err != nil {
				var ne net.Error
				if errors.As(err, &ne) && ne.Timeout() && t.ctx.Err() == nil {
					break // retransmit
				}
				if t.ctx.Err() != nil {
					return false, t.ctx.Err()
				}
				// ICMP port unreachable: the client is gone.
				return false, fmt.Errorf("receive: %w", err)
			}
			if n < 4 {
				continue
			}
			switch binary.BigEndian.Uint16(t.in[:]) {
			case opACK:
				if binary.BigEndian.Uint16(t.in[2:]) == block {
					return true, nil
				}
				// A duplicate ACK of an earlier block: ignore it, so a
				// delayed ACK never doubles the traffic (the Sorcerer's
				// Apprentice bug of RFC 1350).
			case opERROR:
				code := binary.BigEndian.Uint16(t.in[2:])
				return false, fmt.Errorf("%w (code %d: %s)", errClientAbort, code, clip(strings.TrimRight(string(t.in[4:n]), "\x00")))
			}
		}
	}
	return false, errNoAck
}

func outcome(err error) string {
	switch {
	case errors.Is(err, errClientAbort):
		return "aborted"
	case errors.Is(err, errFenced):
		return "fenced"
	case errors.Is(err, errNoAck):
		return "timeout"
	}
	return "error"
}

func reason(err error) string {
	if err == nil {
		return "none"
	}
	return err.Error()
}

// clip bounds a client-supplied string in logs.
func clip(s string) string {
	s = strings.ToValidUTF8(s, "?")
	if len(s) > 128 {
		return s[:128] + "…"
	}
	return s
}
