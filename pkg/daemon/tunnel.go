package daemon

// Tunnels (docs/gateway.md, "Tunnels"): an OpenTunnel on the session stream
// asks the daemon to connect a TCP port on the node's loopback, or start its
// shell, and to attach it to the gateway on a Tunnel stream of its own (on
// the same HTTP/2 connection as the session, so it reaches the same
// gateway). Only ports in Config.TunnelPorts are connected, and the shell
// only when Config.TunnelShell names one; anything else is refused with
// PERMISSION_DENIED in the attach, so the operator sees why.
//
// A shell runs on a pseudo-terminal when the OpenTunnel carries a terminal
// size (with pipes otherwise), in a session of its own; once it exits, its
// remaining output is sent, then one shell_exit, then the half-close.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	"connectrpc.com/connect"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// tunnelChunk is the most bytes read from a target per message.
const tunnelChunk = 32 << 10

// tunnelDialTimeout bounds the dial of a tunnel's TCP target.
const tunnelDialTimeout = 10 * time.Second

// tunnelTarget is a tunnel's local end: a TCP connection or a shell's pipes.
type tunnelTarget interface {
	io.ReadWriter
	// CloseWrite tells the target nothing more will be written.
	CloseWrite() error
	// Close ends the target.
	Close() error
}

// openTunnel connects ot's target and relays it over a new Tunnel stream
// until both directions end or ctx (the session's) ends.
func (d *Daemon) openTunnel(ctx context.Context, ot *nodev1.OpenTunnel) {
	defer d.wg.Done()
	log := d.log.With("tunnel", ot.GetTunnelId())
	attach := &nodev1.TunnelAttach{TunnelId: ot.GetTunnelId(), Token: ot.GetToken()}
	target, code, err := d.connectTarget(ctx, ot)
	if err != nil {
		attach.ErrorCode, attach.ErrorMessage = uint32(code), err.Error()
		d.tunnelsRefused.Add(1)
		log.Info("tunnel refused", "err", err)
	}
	tctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream := d.tunnels.Tunnel(tctx)
	if err := stream.Send(&nodev1.TunnelRequest{Attach: attach}); err != nil || target == nil {
		_ = stream.CloseRequest()
		_, rerr := stream.Receive()
		if target != nil {
			_ = target.Close()
			log.Warn("tunnel attach failed", "err", errors.Join(err, rerr))
		}
		return
	}
	d.tunnelsOpened.Add(1)
	log.Debug("tunnel attached")
	defer func() { _ = target.Close() }()

	sh, _ := target.(*shellProc)
	var wg sync.WaitGroup
	wg.Go(func() {
		// target -> gateway; a read error or EOF half-closes the stream,
		// after a shell's shell_exit.
		defer func() { _ = stream.CloseRequest() }()
		buf := make([]byte, tunnelChunk)
		for {
			n, err := target.Read(buf)
			if n > 0 {
				if serr := stream.Send(&nodev1.TunnelRequest{Data: buf[:n]}); serr != nil {
					return
				}
			}
			if err != nil {
				break
			}
		}
		if sh == nil {
			return
		}
		select {
		case <-sh.exited:
			ex := sh.exitStatus()
			log.Info("tunnel shell exited", "exit_code", ex.GetExitCode(), "signal", ex.GetSignal())
			_ = stream.Send(&nodev1.TunnelRequest{ShellExit: ex})
		case <-tctx.Done():
		}
	})
	// gateway -> target, until the gateway ends the stream.
	writeFailed := false
	for {
		m, err := stream.Receive()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				log.Info("tunnel ended", "err", err)
			}
			break
		}
		if len(m.GetData()) > 0 && !writeFailed {
			if _, err := target.Write(m.GetData()); err != nil {
				if sh == nil {
					log.Info("tunnel target write failed", "err", err)
					break
				}
				// A shell that exited reads nothing more: its input is
				// dropped while its output, shell_exit and the half-close
				// are still on their way.
				log.Debug("tunnel shell input dropped", "err", err)
				writeFailed = true
			}
		}
		if rs := m.GetResize(); rs != nil && sh != nil {
			if err := sh.resize(rs); err != nil {
				log.Info("tunnel shell resize failed", "rows", rs.GetRows(), "cols", rs.GetCols(), "err", err)
			}
		}
		if m.GetEof() {
			_ = target.CloseWrite()
		}
	}
	_ = target.Close() // ends the reader above
	cancel()
	wg.Wait()
}

// connectTarget connects ot's target, or says why not with a Connect code.
func (d *Daemon) connectTarget(ctx context.Context, ot *nodev1.OpenTunnel) (tunnelTarget, connect.Code, error) {
	switch t := ot.GetTarget().(type) {
	case *nodev1.OpenTunnel_Port:
		if t.Port < 1 || t.Port > 65535 || !slices.Contains(d.cfg.TunnelPorts, t.Port) {
			return nil, connect.CodePermissionDenied, fmt.Errorf("port %d is not in node %s's tunnel allowlist (leasehold-node --tunnel.ports, daemon Config.TunnelPorts)", t.Port, d.cfg.NodeID)
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(int(t.Port)))
		c, err := (&net.Dialer{Timeout: tunnelDialTimeout}).DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, connect.CodeUnavailable, fmt.Errorf("node %s could not connect %s: %w", d.cfg.NodeID, addr, err)
		}
		return c.(*net.TCPConn), 0, nil
	case *nodev1.OpenTunnel_Shell:
		if len(d.cfg.TunnelShell) == 0 {
			return nil, connect.CodePermissionDenied, fmt.Errorf("shell tunnels are disabled on node %s (leasehold-node --tunnel.shell, daemon Config.TunnelShell)", d.cfg.NodeID)
		}
		spec := shellSpec{argv: d.cfg.TunnelShell, size: ot.GetTerminalSize(), term: shellTerm(ot.GetTerm())}
		if sz := spec.size; sz != nil && !validTerminalSize(sz) {
			return nil, connect.CodeInvalidArgument, fmt.Errorf("open_tunnel.terminal_size %dx%d: rows and cols must be in 1..%d", sz.GetRows(), sz.GetCols(), maxTerminalCells)
		}
		if d.cfg.TunnelShellUser != "" {
			u, err := lookupShellUser(d.cfg.TunnelShellUser)
			if err != nil {
				return nil, connect.CodeFailedPrecondition, fmt.Errorf("node %s cannot run its shell as %q (leasehold-node --tunnel.shell-user, daemon Config.TunnelShellUser): %w", d.cfg.NodeID, d.cfg.TunnelShellUser, err)
			}
			spec.user = u
		}
		s, err := startShell(spec)
		if err != nil {
			return nil, connect.CodeUnavailable, fmt.Errorf("node %s could not start its shell: %w", d.cfg.NodeID, err)
		}
		return s, 0, nil
	default:
		return nil, connect.CodeInvalidArgument, errors.New("open_tunnel names no target")
	}
}

// maxTerminalCells bounds a terminal's rows and cols.
const maxTerminalCells = 10000

// validTerminalSize says whether sz's rows and cols are both in
// 1..maxTerminalCells.
func validTerminalSize(sz *nodev1.TerminalSize) bool {
	return sz.GetRows() >= 1 && sz.GetRows() <= maxTerminalCells && sz.GetCols() >= 1 && sz.GetCols() <= maxTerminalCells
}

// defaultTerm is the TERM of a pseudo-terminal shell whose caller sent none
// (or one that is not a plain terminal name).
const defaultTerm = "xterm-256color"

// shellTerm is term when it is 1..64 bytes of [A-Za-z0-9._+-], else
// defaultTerm: the value goes into the shell's environment, so it must not
// carry anything but a terminal name.
func shellTerm(term string) string {
	if len(term) == 0 || len(term) > 64 {
		return defaultTerm
	}
	for _, c := range []byte(term) {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_', c == '+', c == '-':
		default:
			return defaultTerm
		}
	}
	return term
}
