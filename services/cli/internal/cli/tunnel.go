package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"
	"golang.org/x/term"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// maxTunnelChunk is the most data one OpenTunnelRequest carries.
const maxTunnelChunk = 64 << 10

type tunnelStream = connect.BidiStreamForClient[controlv1.OpenTunnelRequest, controlv1.OpenTunnelResponse]

// openTunnel sends the open message and waits for opened.
func (s *session) openTunnel(ctx context.Context, open *controlv1.TunnelOpen) (*tunnelStream, *controlv1.TunnelOpened, error) {
	st := s.client.OpenTunnel(ctx)
	if err := st.Send(&controlv1.OpenTunnelRequest{Open: open}); err != nil && !errors.Is(err, io.EOF) {
		_ = st.CloseResponse()
		return nil, nil, s.explainTunnel(err, open.GetNodeId())
	}
	m, err := st.Receive()
	if err != nil {
		_ = st.CloseRequest()
		_ = st.CloseResponse()
		return nil, nil, s.explainTunnel(err, open.GetNodeId())
	}
	if m.GetOpened() == nil {
		_ = st.CloseRequest()
		_ = st.CloseResponse()
		return nil, nil, errors.New("tunnel: the first response did not say opened")
	}
	return st, m.GetOpened(), nil
}

func (s *session) explainTunnel(err error, node string) error {
	switch connect.CodeOf(err) {
	case connect.CodeUnavailable:
		var ne *net.OpError
		if !errors.As(err, &ne) {
			return withHint(err, fmt.Sprintf("node %s is not connected (leasehold nodes get %s); tunnels need a live session", node, node))
		}
	case connect.CodePermissionDenied:
		return withHint(err, "tunnels need the tunnel or admin role, and the node must allow the target (leasehold-node --tunnel.ports / --tunnel.shell)")
	}
	return s.explain(err)
}

// pumpToTunnel sends what r yields as data messages, then half-closes.
func pumpToTunnel(st *tunnelStream, r io.Reader) error {
	buf := make([]byte, maxTunnelChunk)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			if serr := st.Send(&controlv1.OpenTunnelRequest{Data: append([]byte(nil), buf[:n]...)}); serr != nil {
				return serr
			}
		}
		if errors.Is(err, io.EOF) {
			return st.CloseRequest()
		}
		if err != nil {
			_ = st.CloseRequest()
			return err
		}
	}
}

func (a *app) portForwardCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "port-forward NODE LOCAL:REMOTE",
		Short: "Forward 127.0.0.1:LOCAL to port REMOTE on NODE's loopback",
		Long: `Listen on 127.0.0.1:LOCAL (0 picks a free port) and carry each connection to
port REMOTE on NODE's loopback through its own tunnel (OpenTunnel: the tunnel
or admin role, and a port in the node's allowlist). Runs until Ctrl-C.`,
		Args:              exactArgs(2, "NODE and LOCAL:REMOTE"),
		ValidArgsFunction: a.completeNodes,
		RunE: func(cmd *cobra.Command, args []string) error {
			node := args[0]
			local, remote, err := parsePorts(args[1])
			if err != nil {
				return err
			}
			s, err := a.dial()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(local)))
			if err != nil {
				return fmt.Errorf("listen on 127.0.0.1:%d: %w", local, err)
			}
			go func() { <-ctx.Done(); _ = ln.Close() }()
			port := ln.Addr().(*net.TCPAddr).Port
			_, _ = fmt.Fprintf(a.stdout, "Forwarding from 127.0.0.1:%d -> %s:%d\n", port, node, remote)
			var wg sync.WaitGroup
			defer wg.Wait()
			for {
				c, err := ln.Accept()
				if err != nil {
					if ctx.Err() != nil {
						return nil
					}
					return fmt.Errorf("accept on 127.0.0.1:%d: %w", port, err)
				}
				wg.Go(func() { a.forward(ctx, s, c.(*net.TCPConn), node, remote) })
			}
		},
	}
	return cmd
}

func parsePorts(s string) (int, uint32, error) {
	l, r, ok := strings.Cut(s, ":")
	lp, err1 := strconv.ParseUint(l, 10, 16)
	rp, err2 := strconv.ParseUint(r, 10, 16)
	if !ok || err1 != nil || err2 != nil || rp == 0 {
		return 0, 0, usagef("LOCAL:REMOTE %q: want two ports, e.g. 8080:80 (LOCAL 0 picks a free one)", s)
	}
	return int(lp), uint32(rp), nil
}

// forward relays one local connection through its own tunnel, half-closing
// each way as the other side does.
func (a *app) forward(ctx context.Context, s *session, c *net.TCPConn, node string, remote uint32) {
	defer func() { _ = c.Close() }()
	st, opened, err := s.openTunnel(ctx, &controlv1.TunnelOpen{NodeId: node, Target: &controlv1.TunnelTarget{Kind: &controlv1.TunnelTarget_Port{Port: remote}}})
	if err != nil {
		if ctx.Err() == nil {
			report(a.stderr, err, false)
		}
		return
	}
	defer func() { _ = st.CloseResponse() }()
	// On Ctrl-C, closing the local side ends the pump, which half-closes
	// the request: an HTTP/2 request body blocked on a read does not see
	// the context end by itself.
	stop := context.AfterFunc(ctx, func() { _ = c.Close() })
	defer stop()
	a.debugf("connection from %s: tunnel %s via gateway %s", c.RemoteAddr(), opened.GetTunnelId(), opened.GetGatewayId())
	sent := make(chan error, 1)
	go func() { sent <- pumpToTunnel(st, c) }()
	for {
		m, err := st.Receive()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			if ctx.Err() == nil {
				report(a.stderr, s.explainTunnel(err, node), false)
			}
			return
		}
		if len(m.GetData()) > 0 {
			if _, err := c.Write(m.GetData()); err != nil {
				return
			}
		}
		if m.GetEof() {
			_ = c.CloseWrite()
		}
	}
	_ = c.CloseWrite()
	// The node's side ended: stop reading the local side too.
	_ = c.CloseRead()
	<-sent
}

var termRE = regexp.MustCompile(`^[A-Za-z0-9._+-]{1,64}$`)

func (a *app) shellCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "shell NODE",
		Short: "Open a shell on NODE (on a pseudo-terminal when stdin is a terminal)",
		Long: `Open the shell NODE's agent allows (OpenTunnel with a shell target: the tunnel
or admin role, and a node started with a tunnel shell). When stdin is a
terminal the shell runs on a pseudo-terminal of the local terminal's size and
$TERM, the local terminal is in raw mode while it runs, and window size
changes follow; otherwise the shell runs with pipes. The exit status is the
shell's (128+n when signal n ended it).`,
		Args:              exactArgs(1, "NODE"),
		ValidArgsFunction: a.completeNodes,
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.dial()
			if err != nil {
				return err
			}
			return a.runShell(cmd.Context(), s, args[0])
		},
	}
	return cmd
}

func (a *app) runShell(ctx context.Context, s *session, node string) error {
	open := &controlv1.TunnelOpen{NodeId: node, Target: &controlv1.TunnelTarget{Kind: &controlv1.TunnelTarget_Shell{Shell: true}}}
	in, isFile := a.stdin.(*os.File)
	tty := isFile && term.IsTerminal(int(in.Fd()))
	if tty {
		if cols, rows, err := term.GetSize(int(in.Fd())); err == nil && rows > 0 && cols > 0 {
			open.TerminalSize = &nodev1.TerminalSize{Rows: uint32(rows), Cols: uint32(cols)}
		}
		if t := a.getenv("TERM"); termRE.MatchString(t) {
			open.Term = t
		}
	}
	// On a raw terminal Ctrl-C is a byte for the remote shell, not a
	// signal; SIGINT or SIGTERM from elsewhere end the tunnel (exit 130).
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, opened, err := s.openTunnel(sctx, open)
	if err != nil {
		return err
	}
	defer func() { _ = st.CloseResponse() }()
	a.debugf("shell tunnel %s via gateway %s", opened.GetTunnelId(), opened.GetGatewayId())

	var sendMu sync.Mutex
	send := func(m *controlv1.OpenTunnelRequest) error {
		sendMu.Lock()
		defer sendMu.Unlock()
		return st.Send(m)
	}
	// Ending the tunnel half-closes our side first: an HTTP/2 request
	// body blocked on a read does not see the context end by itself.
	stopClose := context.AfterFunc(sctx, func() {
		sendMu.Lock()
		defer sendMu.Unlock()
		_ = st.CloseRequest()
	})
	defer stopClose()
	if tty && open.TerminalSize != nil {
		old, err := term.MakeRaw(int(in.Fd()))
		if err != nil {
			return fmt.Errorf("raw mode: %w", err)
		}
		defer func() { _ = term.Restore(int(in.Fd()), old) }()
		winch := make(chan os.Signal, 1)
		signal.Notify(winch, syscall.SIGWINCH)
		defer signal.Stop(winch)
		go func() {
			for {
				select {
				case <-sctx.Done():
					return
				case <-winch:
					if cols, rows, err := term.GetSize(int(in.Fd())); err == nil && rows > 0 && cols > 0 {
						_ = send(&controlv1.OpenTunnelRequest{Resize: &nodev1.TerminalSize{Rows: uint32(rows), Cols: uint32(cols)}})
					}
				}
			}
		}()
	}
	go func() {
		buf := make([]byte, 32<<10)
		for {
			n, err := a.stdin.Read(buf)
			if n > 0 {
				if send(&controlv1.OpenTunnelRequest{Data: append([]byte(nil), buf[:n]...)}) != nil {
					return
				}
			}
			if err != nil {
				sendMu.Lock()
				_ = st.CloseRequest()
				sendMu.Unlock()
				return
			}
		}
	}()
	var exit *nodev1.ShellExit
	for {
		m, err := st.Receive()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			if ctx.Err() != nil {
				return interrupted
			}
			return s.explainTunnel(err, node)
		}
		if len(m.GetData()) > 0 {
			_, _ = a.stdout.Write(m.GetData())
		}
		if m.GetShellExit() != nil {
			exit = m.GetShellExit()
		}
		if m.GetEof() {
			// The shell ended: half-close our side too (stdin may never
			// end on a terminal), and read the stream to its OK end.
			sendMu.Lock()
			_ = st.CloseRequest()
			sendMu.Unlock()
		}
	}
	if exit == nil {
		return errors.New("the shell's tunnel ended without its exit status")
	}
	if exit.GetSignal() != "" {
		code := exitFailed
		if n := signalNumber(exit.GetSignal()); n > 0 {
			code = 128 + n
		}
		return &exitError{code: code, msg: fmt.Sprintf("the shell on %s was killed by %s", node, exit.GetSignal())}
	}
	if c := exit.GetExitCode(); c != 0 {
		return &exitError{code: int(c) & 0xff}
	}
	return nil
}

// signalNumber maps "SIGKILL" to 9; 0 when unknown.
func signalNumber(name string) int {
	for n := 1; n < 65; n++ {
		if unix.SignalName(syscall.Signal(n)) == name {
			return n
		}
	}
	return 0
}
