package daemon

import (
	"bytes"
	"context"
	"errors"
	"io"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

type tunnelResult struct {
	attach *nodev1.TunnelAttach
	data   []byte
	err    error
}

// tunnelFake welcomes the daemon, sends opens on its session, and for each
// Tunnel stream records the attach; on an accepted one it sends input, then
// eof, and records what comes back until the daemon half-closes.
func tunnelFake(t *testing.T, opens []*nodev1.OpenTunnel, input []byte) (string, <-chan tunnelResult) {
	t.Helper()
	results := make(chan tunnelResult, len(opens))
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
		tunnel: func(_ context.Context, s *connect.BidiStream[nodev1.TunnelRequest, nodev1.TunnelResponse]) error {
			first, err := s.Receive()
			if err != nil {
				results <- tunnelResult{err: err}
				return err
			}
			r := tunnelResult{attach: first.GetAttach()}
			if r.attach.GetErrorCode() != 0 {
				results <- r
				return nil
			}
			if err := s.Send(&nodev1.TunnelResponse{Data: input}); err != nil {
				r.err = err
			} else if err := s.Send(&nodev1.TunnelResponse{Eof: true}); err != nil {
				r.err = err
			}
			var got bytes.Buffer
			for r.err == nil {
				m, err := s.Receive()
				if errors.Is(err, io.EOF) {
					break
				}
				if err != nil {
					r.err = err
					break
				}
				got.Write(m.GetData())
			}
			r.data = got.Bytes()
			results <- r
			return nil
		},
	}
	return startFake(t, f), results
}

func runDaemon(t *testing.T, cfg Config) {
	t.Helper()
	cfg.NodeID, cfg.Credential = "n1", "c"
	cfg.Handler = func(context.Context, *nodev1.Command) Outcome { return Outcome{} }
	d, err := New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = d.Run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait() })
}

func awaitTunnel(t *testing.T, results <-chan tunnelResult) tunnelResult {
	t.Helper()
	select {
	case r := <-results:
		return r
	case <-time.After(60 * time.Second):
		t.Fatal("no Tunnel stream from the daemon")
		return tunnelResult{}
	}
}

// TestTunnelRefusedByDefault: with no allowlist and no shell, the daemon
// attaches every tunnel with PERMISSION_DENIED and says why.
func TestTunnelRefusedByDefault(t *testing.T) {
	t.Parallel()
	addr, results := tunnelFake(t, []*nodev1.OpenTunnel{
		{TunnelId: "t-port", Token: []byte("k1"), Target: &nodev1.OpenTunnel_Port{Port: 22}},
		{TunnelId: "t-shell", Token: []byte("k2"), Target: &nodev1.OpenTunnel_Shell{Shell: true}},
	}, nil)
	runDaemon(t, Config{Address: addr})
	got := map[string]*nodev1.TunnelAttach{}
	for range 2 {
		r := awaitTunnel(t, results)
		require.NoError(t, r.err)
		got[r.attach.GetTunnelId()] = r.attach
	}
	require.Equal(t, uint32(connect.CodePermissionDenied), got["t-port"].GetErrorCode())
	require.Contains(t, got["t-port"].GetErrorMessage(), "port 22 is not in node n1's tunnel allowlist")
	require.Equal(t, []byte("k1"), got["t-port"].GetToken(), "the attach carries the open's token")
	require.Equal(t, uint32(connect.CodePermissionDenied), got["t-shell"].GetErrorCode())
	require.Contains(t, got["t-shell"].GetErrorMessage(), "shell tunnels are disabled")
}

// TestTunnelShellThroughPipes: an enabled shell reads the tunnel's bytes as
// its stdin, the eof closes its stdin, and its output comes back until it
// exits and the daemon half-closes.
func TestTunnelShellThroughPipes(t *testing.T) {
	t.Parallel()
	addr, results := tunnelFake(t, []*nodev1.OpenTunnel{
		{TunnelId: "t1", Token: []byte("k"), Target: &nodev1.OpenTunnel_Shell{Shell: true}},
	}, []byte("echo out; echo err >&2; read x || echo stdin-closed\n"))
	runDaemon(t, Config{Address: addr, TunnelShell: []string{"/bin/sh"}})
	r := awaitTunnel(t, results)
	require.NoError(t, r.err)
	require.Zero(t, r.attach.GetErrorCode(), r.attach.GetErrorMessage())
	require.Equal(t, "out\nerr\nstdin-closed\n", string(r.data))
}
