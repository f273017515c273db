package e2e

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
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/daemon"
	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

// ptyTunnel is a shell tunnel as its caller sees it.
type ptyTunnel struct {
	t    *testing.T
	st   *tunnelStream
	seen bytes.Buffer
	mark int
}

func (p *ptyTunnel) send(m *controlv1.OpenTunnelRequest) {
	p.t.Helper()
	require.NoError(p.t, p.st.Send(m))
}

func (p *ptyTunnel) typeLine(line string) {
	p.t.Helper()
	p.send(&controlv1.OpenTunnelRequest{Data: []byte(line + "\n")})
}

// expect reads output until it holds want after what earlier expects
// consumed (the caller's context bounds the wait).
func (p *ptyTunnel) expect(want string) {
	p.t.Helper()
	for !strings.Contains(p.seen.String()[p.mark:], want) {
		m, err := p.st.Receive()
		require.NoError(p.t, err, "waiting for %q; output: %q", want, p.seen.String())
		require.Nil(p.t, m.GetShellExit(), "the shell exited before %q; output: %q", want, p.seen.String())
		require.False(p.t, m.GetEof(), "the node's side ended before %q; output: %q", want, p.seen.String())
		p.seen.Write(m.GetData())
	}
	p.mark += strings.Index(p.seen.String()[p.mark:], want) + len(want)
}

// awaitExit reads up to the shell_exit, requires the node's eof next, then
// half-closes and requires the tunnel to end OK.
func (p *ptyTunnel) awaitExit() *nodev1.ShellExit {
	p.t.Helper()
	var ex *nodev1.ShellExit
	for ex == nil {
		m, err := p.st.Receive()
		require.NoError(p.t, err, "waiting for shell_exit; output: %q", p.seen.String())
		require.False(p.t, m.GetEof(), "eof before shell_exit")
		p.seen.Write(m.GetData())
		ex = m.GetShellExit()
	}
	m, err := p.st.Receive()
	require.NoError(p.t, err)
	require.True(p.t, m.GetEof(), "the node's eof follows shell_exit")
	require.Empty(p.t, m.GetData())
	require.NoError(p.t, p.st.CloseRequest())
	_, err = p.st.Receive()
	require.ErrorIs(p.t, err, io.EOF, "the tunnel ends OK once both sides half-closed")
	_ = p.st.CloseResponse()
	return ex
}

// TestTunnelShellPty runs a gateway with its relay, an api and an
// in-process daemon with a shell: a shell opened with 40x132 and a TERM
// reads that size and TERM on its pseudo-terminal, a resize to 50x100
// reaches it, exit 3 comes back as shell_exit 3 (and in the tunnel.close
// audit row), a shell killed by SIGKILL says so, closing the tunnel leaves
// no process of its session, a bad resize is INVALID_ARGUMENT naming
// resize, and a port outside the allowlist is PERMISSION_DENIED.
func TestTunnelShellPty(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ids, creds := fleettest.RegisterNodes(t, db.Pool, "pty", 1)
	tokenFile := filepath.Join(t.TempDir(), "relay-token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(tunnelRelayToken+"\n"), 0o600))
	env := []string{"LEASEHOLD_API_TOKENS=tunnel:" + tunnelToken}
	start := func(service, name string, extra ...string) *proctest.Proc {
		args := append([]string{"--database-url", db.URL, "--http-addr", fleettest.Addr(t), "--id", name, "--log-format", "text"},
			fleettest.DBFlags(db.URL)...)
		p := proctest.Start(t, name, fleettest.Binary(t, service), env, append(args, extra...)...)
		p.WaitReady(60 * time.Second)
		return p
	}
	gwAddr := fleettest.Addr(t)
	start("gateway", "gw_pty", append([]string{"--listen-addr", gwAddr, "--gateway.relay-listen-addr", fleettest.Addr(t),
		"--gateway.relay-token-file", tokenFile}, fleettest.FastGateway...)...)
	apiAddr := fleettest.Addr(t)
	start("api", "api_pty", "--listen-addr", apiAddr, "--api.relay-token-file", tokenFile)
	tun := controlClient{controlv1connect.NewControlServiceClient(h2cClient(), "http://"+apiAddr), tunnelToken}

	d, err := daemon.New(daemon.Config{Address: "http://" + gwAddr, NodeID: ids[0], Credential: creds[0],
		Handler:     func(context.Context, *nodev1.Command) daemon.Outcome { return daemon.Outcome{} },
		BackoffBase: 50 * time.Millisecond, BackoffMax: 500 * time.Millisecond,
		TunnelShell: []string{"/bin/sh"}})
	require.NoError(t, err)
	dctx, dcancel := context.WithCancel(context.Background())
	var dwg sync.WaitGroup
	dwg.Go(func() { _ = d.Run(dctx) })
	t.Cleanup(func() { dcancel(); dwg.Wait() })

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	shell := &controlv1.TunnelTarget{Kind: &controlv1.TunnelTarget_Shell{Shell: true}}
	// open retries UNAVAILABLE until the node's session is up.
	open := func(t *testing.T, ctx context.Context, o *controlv1.TunnelOpen) (*ptyTunnel, *controlv1.TunnelOpened) {
		t.Helper()
		o.NodeId = ids[0]
		for {
			st, opened, err := openTunnel(ctx, tun, o)
			if err == nil {
				return &ptyTunnel{t: t, st: st}, opened
			}
			require.Equal(t, connect.CodeUnavailable, connect.CodeOf(err), "%v", err)
			select {
			case <-ctx.Done():
				t.Fatalf("no tunnel before the test's deadline: %v", err)
			case <-time.After(100 * time.Millisecond): // poll interval while the node connects
			}
		}
	}

	t.Run("size, TERM, resize and exit status", func(t *testing.T) {
		p, opened := open(t, ctx, &controlv1.TunnelOpen{Target: shell, TerminalSize: &nodev1.TerminalSize{Rows: 40, Cols: 132}, Term: "screen.e2e+test"})
		// Matched on what the shell prints, never on the echo of what was
		// typed.
		p.typeLine("stty size")
		p.expect("40 132\r\n")
		p.typeLine(`echo "T:$TERM:"`)
		p.expect("T:screen.e2e+test:")
		p.send(&controlv1.OpenTunnelRequest{Resize: &nodev1.TerminalSize{Rows: 50, Cols: 100}})
		p.typeLine("stty size")
		p.expect("50 100\r\n")
		p.typeLine("exit 3")
		ex := p.awaitExit()
		require.Equal(t, int32(3), ex.GetExitCode())
		require.Empty(t, ex.GetSignal())

		var code int
		require.Eventually(t, func() bool {
			return db.Pool.QueryRow(ctx, `SELECT (detail->>'shell_exit_code')::int FROM audit_events
			   WHERE method = 'tunnel.close' AND outcome = 'ok' AND detail->>'tunnel_id' = $1`, opened.GetTunnelId()).Scan(&code) == nil
		}, 30*time.Second, 50*time.Millisecond, "tunnel.close records how the shell ended")
		require.Equal(t, 3, code)
	})

	t.Run("a shell killed by a signal", func(t *testing.T) {
		p, _ := open(t, ctx, &controlv1.TunnelOpen{Target: shell, TerminalSize: &nodev1.TerminalSize{Rows: 24, Cols: 80}})
		p.typeLine("kill -KILL $$")
		ex := p.awaitExit()
		require.Equal(t, int32(-1), ex.GetExitCode())
		require.Equal(t, "SIGKILL", ex.GetSignal())
	})

	t.Run("closing the tunnel leaves no process", func(t *testing.T) {
		b := make([]byte, 8)
		_, _ = rand.Read(b)
		marker := "lh-e2e-marker-" + hex.EncodeToString(b)
		tctx, tcancel := context.WithCancel(ctx)
		defer tcancel()
		p, _ := open(t, tctx, &controlv1.TunnelOpen{Target: shell, TerminalSize: &nodev1.TerminalSize{Rows: 24, Cols: 80}})
		p.typeLine("sh -c 'sleep 600; : " + marker + "-bg' & sh -c 'sleep 600; : " + marker + "-fg'")
		require.Eventually(t, func() bool { return len(markerPids(marker)) == 2 }, 30*time.Second, 20*time.Millisecond,
			"a background and a foreground job run")
		tcancel() // the caller goes away
		_ = p.st.CloseResponse()
		require.Eventually(t, func() bool { return len(markerPids(marker)) == 0 }, 30*time.Second, 20*time.Millisecond,
			"no process of the tunnel's shell is left")
	})

	t.Run("bad resize", func(t *testing.T) {
		p, _ := open(t, ctx, &controlv1.TunnelOpen{Target: shell, TerminalSize: &nodev1.TerminalSize{Rows: 24, Cols: 80}})
		p.send(&controlv1.OpenTunnelRequest{Resize: &nodev1.TerminalSize{Rows: 0, Cols: 80}})
		requireTunnelEnds(t, p.st, connect.CodeInvalidArgument, "resize:")

		p, _ = open(t, ctx, &controlv1.TunnelOpen{Target: shell})
		p.send(&controlv1.OpenTunnelRequest{Resize: &nodev1.TerminalSize{Rows: 24, Cols: 80}})
		requireTunnelEnds(t, p.st, connect.CodeInvalidArgument, "resize:")
	})

	t.Run("a port outside the allowlist", func(t *testing.T) {
		_, _, err := openTunnel(ctx, tun, &controlv1.TunnelOpen{NodeId: ids[0], Target: portTarget(22)})
		require.Equal(t, connect.CodePermissionDenied, connect.CodeOf(err), "%v", err)
		require.ErrorContains(t, err, "allowlist")
	})
}

// requireTunnelEnds reads st until it fails, and requires code and a
// message starting with prefix.
func requireTunnelEnds(t *testing.T, st *tunnelStream, code connect.Code, prefix string) {
	t.Helper()
	defer func() { _ = st.CloseResponse() }()
	for {
		_, err := st.Receive()
		if err == nil {
			continue
		}
		var ce *connect.Error
		require.True(t, errors.As(err, &ce), "%v", err)
		require.Equal(t, code, ce.Code(), "%v", err)
		require.True(t, strings.HasPrefix(ce.Message(), prefix), "%q should start with %q", ce.Message(), prefix)
		return
	}
}

// markerPids are the processes whose command line holds marker.
func markerPids(marker string) []string {
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
