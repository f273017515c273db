//go:build linux

package daemon

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// shellConv is one Tunnel stream as the gateway side sees it, driven by the
// test: what the daemon sent after its attach arrives on msgs, closed when
// the daemon half-closes (or the stream fails: err).
type shellConv struct {
	t      *testing.T
	attach *nodev1.TunnelAttach
	stream *connect.BidiStream[nodev1.TunnelRequest, nodev1.TunnelResponse]
	msgs   chan *nodev1.TunnelRequest
	err    error // set before msgs is closed
	// end makes the handler return err: the daemon's stream ends.
	end  chan error
	seen bytes.Buffer // data so far
	mark int          // how much of seen expect has consumed
}

// shellFake welcomes the daemon, sends opens on its session and hands every
// Tunnel stream to the test.
func shellFake(t *testing.T, opens ...*nodev1.OpenTunnel) (string, <-chan *shellConv) {
	t.Helper()
	convs := make(chan *shellConv, len(opens))
	f := &fakeGateway{
		script: func(n int64, ctx context.Context, s *stream) error {
			if err := welcome(s); err != nil {
				return err
			}
			if n == 1 {
				for _, o := range opens {
					if err := s.Send(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_OpenTunnel{OpenTunnel: o}}); err != nil {
						return err
					}
				}
			}
			return drainUntilDone(ctx, s)
		},
		tunnel: func(ctx context.Context, s *connect.BidiStream[nodev1.TunnelRequest, nodev1.TunnelResponse]) error {
			first, err := s.Receive()
			if err != nil {
				return err
			}
			c := &shellConv{t: t, attach: first.GetAttach(), stream: s, msgs: make(chan *nodev1.TunnelRequest, 64), end: make(chan error, 1)}
			go func() {
				defer close(c.msgs)
				for {
					m, err := s.Receive()
					if err != nil {
						if !errors.Is(err, io.EOF) {
							c.err = err
						}
						return
					}
					c.msgs <- m
				}
			}()
			convs <- c
			if c.attach.GetErrorCode() != 0 {
				return nil
			}
			select {
			case err := <-c.end:
				return err
			case <-ctx.Done():
				return ctx.Err()
			}
		},
	}
	return startFake(t, f), convs
}

// awaitConvs collects n Tunnel streams by tunnel id; each is ended when the
// test ends.
func awaitConvs(t *testing.T, convs <-chan *shellConv, n int) map[string]*shellConv {
	t.Helper()
	got := map[string]*shellConv{}
	for range n {
		select {
		case c := <-convs:
			got[c.attach.GetTunnelId()] = c
			t.Cleanup(func() { c.close(nil) })
		case <-time.After(60 * time.Second):
			t.Fatalf("%d of %d Tunnel streams from the daemon", len(got), n)
		}
	}
	return got
}

func (c *shellConv) send(m *nodev1.TunnelResponse) {
	c.t.Helper()
	require.NoError(c.t, c.stream.Send(m))
}

func (c *shellConv) typeLine(line string) {
	c.t.Helper()
	c.send(&nodev1.TunnelResponse{Data: []byte(line + "\n")})
}

// close ends the stream from the gateway's side (once).
func (c *shellConv) close(err error) {
	select {
	case c.end <- err:
	default:
	}
}

// next is the daemon's next message; nil once it half-closed.
func (c *shellConv) next() *nodev1.TunnelRequest {
	c.t.Helper()
	select {
	case m, ok := <-c.msgs:
		if !ok {
			require.NoError(c.t, c.err, "the daemon's Tunnel stream failed")
			return nil
		}
		return m
	case <-time.After(30 * time.Second):
		c.t.Fatalf("nothing from the daemon for 30 s; output so far: %q", c.seen.String())
		return nil
	}
}

// expect reads output until it holds want after what earlier expects
// consumed; a shell_exit or the half-close first fails the test.
func (c *shellConv) expect(want string) {
	c.t.Helper()
	for {
		if i := strings.Index(c.seen.String()[c.mark:], want); i >= 0 {
			c.mark += i + len(want)
			return
		}
		m := c.next()
		require.NotNil(c.t, m, "the daemon half-closed before %q; output: %q", want, c.seen.String())
		require.Nil(c.t, m.GetShellExit(), "the shell exited before %q; output: %q", want, c.seen.String())
		c.seen.Write(m.GetData())
	}
}

// awaitExit reads output up to the shell_exit, requires the half-close
// right after it, and returns it.
func (c *shellConv) awaitExit() *nodev1.ShellExit {
	c.t.Helper()
	for {
		m := c.next()
		require.NotNil(c.t, m, "the daemon half-closed without a shell_exit; output: %q", c.seen.String())
		c.seen.Write(m.GetData())
		if ex := m.GetShellExit(); ex != nil {
			require.Empty(c.t, m.GetData(), "shell_exit comes alone, after the data")
			require.Nil(c.t, c.next(), "the daemon half-closes right after shell_exit")
			return ex
		}
	}
}

func shellOpen(id string, size *nodev1.TerminalSize, term string) *nodev1.OpenTunnel {
	return &nodev1.OpenTunnel{TunnelId: id, Token: []byte("k-" + id), Target: &nodev1.OpenTunnel_Shell{Shell: true}, TerminalSize: size, Term: term}
}

// TestTunnelShellPty: a shell opened with a terminal size runs on a
// pseudo-terminal of that size, with the TERM sent, as the leader of its own
// session with the terminal as its controlling tty; a resize changes the
// size it reads; exit 3 comes back as shell_exit 3 after its output, then
// the daemon half-closes.
func TestTunnelShellPty(t *testing.T) {
	t.Parallel()
	addr, convs := shellFake(t, shellOpen("pty", &nodev1.TerminalSize{Rows: 40, Cols: 132}, "screen.lh+test-1"))
	runDaemon(t, Config{Address: addr, TunnelShell: []string{"/bin/sh"}})
	c := awaitConvs(t, convs, 1)["pty"]
	require.Zero(t, c.attach.GetErrorCode(), c.attach.GetErrorMessage())

	// Output is matched on what the shell prints, never on the echo of
	// what was typed ($((...)) is only expanded in the output).
	c.typeLine("stty size")
	c.expect("40 132\r\n")
	c.typeLine(`echo "T:$TERM:"`)
	c.expect("T:screen.lh+test-1:")
	c.typeLine(`[ "$(cut -d' ' -f6 /proc/$$/stat)" = $$ ] && [ "$(cut -d' ' -f7 /proc/$$/stat)" != 0 ] && [ -t 0 ] && echo "SESSION-$((6*7))"`)
	c.expect("SESSION-42")

	c.send(&nodev1.TunnelResponse{Resize: &nodev1.TerminalSize{Rows: 50, Cols: 100}})
	c.typeLine("stty size")
	c.expect("50 100\r\n")

	c.typeLine(`echo "last-$((2+2))"; exit 3`)
	c.expect("last-4")
	ex := c.awaitExit()
	require.Equal(t, int32(3), ex.GetExitCode())
	require.Empty(t, ex.GetSignal())
}

// TestTunnelShellExitStatus: on a pseudo-terminal and with pipes, an exit
// code comes back as is and a shell killed by a signal as -1 with the
// signal's name; a TERM that is not a plain terminal name is replaced by
// the default; the caller's eof ends a shell at its prompt on a
// pseudo-terminal too (end-of-file character).
func TestTunnelShellExitStatus(t *testing.T) {
	t.Parallel()
	size := &nodev1.TerminalSize{Rows: 24, Cols: 80}
	addr, convs := shellFake(t,
		shellOpen("pty-exit", size, "bad term;$(x)"),
		shellOpen("pty-kill", size, ""),
		shellOpen("pty-eof", size, "vt100"),
		shellOpen("pipes-exit", nil, ""),
		shellOpen("pipes-kill", nil, ""),
	)
	runDaemon(t, Config{Address: addr, TunnelShell: []string{"/bin/sh"}})
	cs := awaitConvs(t, convs, 5)
	for id, c := range cs {
		require.Zero(t, c.attach.GetErrorCode(), "%s: %s", id, c.attach.GetErrorMessage())
	}

	c := cs["pty-exit"]
	c.typeLine(`echo "T:$TERM:"`)
	c.expect("T:xterm-256color:")
	c.typeLine("exit 7")
	require.Equal(t, &nodev1.ShellExit{ExitCode: 7}, stripExit(c.awaitExit()))

	c = cs["pty-kill"]
	c.typeLine("kill -KILL $$")
	require.Equal(t, &nodev1.ShellExit{ExitCode: -1, Signal: "SIGKILL"}, stripExit(c.awaitExit()))

	c = cs["pty-eof"]
	c.typeLine(`echo "eof-$((1+1))"`)
	c.expect("eof-2")
	c.send(&nodev1.TunnelResponse{Eof: true})
	require.Equal(t, &nodev1.ShellExit{ExitCode: 0}, stripExit(c.awaitExit()))

	c = cs["pipes-exit"]
	c.typeLine(`echo out; echo err >&2; exit 5`)
	require.Equal(t, &nodev1.ShellExit{ExitCode: 5}, stripExit(c.awaitExit()))
	require.Equal(t, "out\nerr\n", c.seen.String(), "all the output comes before shell_exit")

	c = cs["pipes-kill"]
	c.typeLine("kill -TERM $$")
	require.Equal(t, &nodev1.ShellExit{ExitCode: -1, Signal: "SIGTERM"}, stripExit(c.awaitExit()))
}

func stripExit(ex *nodev1.ShellExit) *nodev1.ShellExit {
	return &nodev1.ShellExit{ExitCode: ex.GetExitCode(), Signal: ex.GetSignal()}
}

// markerProcs are the pids whose command line holds marker.
func markerProcs(marker string) []string {
	var pids []string
	dirs, _ := os.ReadDir("/proc")
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join("/proc", d.Name(), "cmdline"))
		if err == nil && bytes.Contains(b, []byte(marker)) {
			pids = append(pids, d.Name())
		}
	}
	return pids
}

// TestTunnelShellLeavesNoProcess: closing a tunnel kills its shell and
// every process of the shell's session (a job in the background and one in
// the foreground); a shell that exits takes its background jobs with it, so
// they neither outlive it nor hold its terminal or pipe open. On a
// pseudo-terminal (job control puts jobs in groups of their own) and with
// pipes.
func TestTunnelShellLeavesNoProcess(t *testing.T) {
	t.Parallel()
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	marker := "lh-tunnel-marker-" + hex.EncodeToString(b)
	size := &nodev1.TerminalSize{Rows: 24, Cols: 80}
	addr, convs := shellFake(t,
		shellOpen("pty-close", size, ""), shellOpen("pty-exit", size, ""),
		shellOpen("pipes-close", nil, ""), shellOpen("pipes-exit", nil, ""))
	runDaemon(t, Config{Address: addr, TunnelShell: []string{"/bin/sh"}})
	cs := awaitConvs(t, convs, 4)
	for id, c := range cs {
		require.Zero(t, c.attach.GetErrorCode(), "%s: %s", id, c.attach.GetErrorMessage())
		m := marker + "-" + id
		if strings.HasSuffix(id, "-close") {
			c.typeLine("sh -c 'sleep 600; : " + m + "-bg' & sh -c 'sleep 600; : " + m + "-fg'")
		} else {
			c.typeLine("sh -c 'sleep 600; : " + m + "-bg' &")
		}
	}
	require.Eventually(t, func() bool { return len(markerProcs(marker)) == 6 }, 30*time.Second, 20*time.Millisecond,
		"two marker processes in each closing tunnel, one in each exiting one")

	cs["pty-close"].close(connect.NewError(connect.CodeCanceled, errors.New("the caller closed the tunnel")))
	cs["pipes-close"].close(connect.NewError(connect.CodeCanceled, errors.New("the caller closed the tunnel")))
	for _, id := range []string{"pty-exit", "pipes-exit"} {
		cs[id].typeLine("exit 0")
		require.Equal(t, &nodev1.ShellExit{ExitCode: 0}, stripExit(cs[id].awaitExit()), id)
	}
	require.Eventually(t, func() bool { return len(markerProcs(marker)) == 0 }, 30*time.Second, 20*time.Millisecond,
		"no process of a closed tunnel's or an exited shell's session is left")
}

// TestTunnelShellUser: a shell runs as TunnelShellUser (its uid, in "/" when
// its home does not exist, on a terminal it owns); a user that does not
// exist refuses the tunnel FAILED_PRECONDITION, and a terminal size out of
// range refuses it INVALID_ARGUMENT.
func TestTunnelShellUser(t *testing.T) {
	t.Parallel()
	size := &nodev1.TerminalSize{Rows: 24, Cols: 80}
	addr, convs := shellFake(t, shellOpen("missing", size, ""))
	runDaemon(t, Config{Address: addr, TunnelShell: []string{"/bin/sh"}, TunnelShellUser: "lh-no-such-user"})
	c := awaitConvs(t, convs, 1)["missing"]
	require.Equal(t, uint32(connect.CodeFailedPrecondition), c.attach.GetErrorCode())
	require.Contains(t, c.attach.GetErrorMessage(), `node n1 cannot run its shell as "lh-no-such-user" (leasehold-node --tunnel.shell-user, daemon Config.TunnelShellUser)`)

	addr, convs = shellFake(t, shellOpen("rows0", &nodev1.TerminalSize{Rows: 0, Cols: 80}, ""),
		shellOpen("cols", &nodev1.TerminalSize{Rows: 24, Cols: 10001}, ""))
	runDaemon(t, Config{Address: addr, TunnelShell: []string{"/bin/sh"}})
	for id, c := range awaitConvs(t, convs, 2) {
		require.Equal(t, uint32(connect.CodeInvalidArgument), c.attach.GetErrorCode(), id)
		require.Contains(t, c.attach.GetErrorMessage(), "open_tunnel.terminal_size", id)
	}

	if os.Geteuid() != 0 {
		t.Skip("running a shell as another user needs root")
	}
	addr, convs = shellFake(t, shellOpen("pty", size, ""), shellOpen("pipes", nil, ""))
	runDaemon(t, Config{Address: addr, TunnelShell: []string{"/bin/sh"}, TunnelShellUser: "nobody"})
	cs := awaitConvs(t, convs, 2)
	c = cs["pty"]
	require.Zero(t, c.attach.GetErrorCode(), c.attach.GetErrorMessage())
	c.typeLine(`echo "U-$(id -un)-$(stat -c %U "$(tty)")-$(pwd)-$HOME-$((1))"`)
	c.expect("U-nobody-nobody-/-/nonexistent-1")
	c.typeLine("exit")
	require.Equal(t, int32(0), c.awaitExit().GetExitCode())
	c = cs["pipes"]
	require.Zero(t, c.attach.GetErrorCode(), c.attach.GetErrorMessage())
	c.typeLine(`echo "U-$(id -un)-$(id -u)-$USER"; exit 0`)
	require.Equal(t, int32(0), c.awaitExit().GetExitCode())
	require.Equal(t, "U-nobody-65534-nobody\n", c.seen.String())
}

// TestShellTerm: TERM is kept when it is a plain terminal name of at most
// 64 bytes, else replaced by the default.
func TestShellTerm(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"": defaultTerm, "xterm": "xterm", "screen.xterm-256color": "screen.xterm-256color", "rxvt+unicode_x": "rxvt+unicode_x",
		"a b": defaultTerm, "x;rm": defaultTerm, "x\n": defaultTerm, "é": defaultTerm,
		strings.Repeat("x", 64): strings.Repeat("x", 64), strings.Repeat("x", 65): defaultTerm,
	} {
		require.Equal(t, want, shellTerm(in), "%q", in)
	}
}
