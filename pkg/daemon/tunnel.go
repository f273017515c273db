package daemon

// Tunnels (docs/gateway.md, "Tunnels"): an OpenTunnel on the session stream
// asks the daemon to connect a TCP port on the node's loopback, or start its
// shell, and to attach it to the gateway on a Tunnel stream of its own (on
// the same HTTP/2 connection as the session, so it reaches the same
// gateway). Only ports in Config.TunnelPorts are connected, and the shell
// only when Config.TunnelShell names one; anything else is refused with
// PERMISSION_DENIED in the attach, so the operator sees why.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
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

	var wg sync.WaitGroup
	wg.Go(func() {
		// target -> gateway; a read error or EOF half-closes the stream.
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
				return
			}
		}
	})
	// gateway -> target, until the gateway ends the stream.
	for {
		m, err := stream.Receive()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				log.Info("tunnel ended", "err", err)
			}
			break
		}
		if len(m.GetData()) > 0 {
			if _, err := target.Write(m.GetData()); err != nil {
				log.Info("tunnel target write failed", "err", err)
				break
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
			return nil, connect.CodePermissionDenied, fmt.Errorf("port %d is not in node %s's tunnel allowlist (daemon TunnelPorts)", t.Port, d.cfg.NodeID)
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(int(t.Port)))
		c, err := (&net.Dialer{Timeout: tunnelDialTimeout}).DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, connect.CodeUnavailable, fmt.Errorf("node %s could not connect %s: %w", d.cfg.NodeID, addr, err)
		}
		return c.(*net.TCPConn), 0, nil
	case *nodev1.OpenTunnel_Shell:
		if len(d.cfg.TunnelShell) == 0 {
			return nil, connect.CodePermissionDenied, fmt.Errorf("shell tunnels are disabled on node %s (daemon TunnelShell)", d.cfg.NodeID)
		}
		s, err := startShell(d.cfg.TunnelShell)
		if err != nil {
			return nil, connect.CodeUnavailable, fmt.Errorf("node %s could not start its shell: %w", d.cfg.NodeID, err)
		}
		return s, 0, nil
	default:
		return nil, connect.CodeInvalidArgument, errors.New("open_tunnel names no target")
	}
}

// shell is a shell process behind pipes: writes go to its stdin, reads
// come from its stdout and stderr together.
type shell struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *os.File
	once  sync.Once
}

func startShell(argv []string) (*shell, error) {
	cmd := exec.Command(argv[0], argv[1:]...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	cmd.Stdout, cmd.Stderr = w, w
	if err := cmd.Start(); err != nil {
		_ = r.Close()
		_ = w.Close()
		return nil, err
	}
	_ = w.Close() // the child holds its copy: EOF once it exits
	return &shell{cmd: cmd, stdin: stdin, out: r}, nil
}

func (s *shell) Read(p []byte) (int, error)  { return s.out.Read(p) }
func (s *shell) Write(p []byte) (int, error) { return s.stdin.Write(p) }
func (s *shell) CloseWrite() error           { return s.stdin.Close() }

// Close kills the shell if it still runs and reaps it.
func (s *shell) Close() error {
	s.once.Do(func() {
		_ = s.stdin.Close()
		_ = s.cmd.Process.Kill()
		_ = s.cmd.Wait()
		_ = s.out.Close()
	})
	return nil
}
