package api

import (
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// TestTunnelOpenTerminalInvalid: a terminal size or TERM the api does not
// take is INVALID_ARGUMENT naming open.terminal_size or open.term, before
// any lookup, and writes nothing.
func TestTunnelOpenTerminalInvalid(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	before := b.rowCounts()
	shell := &controlv1.TunnelTarget{Kind: &controlv1.TunnelTarget_Shell{Shell: true}}
	port := &controlv1.TunnelTarget{Kind: &controlv1.TunnelTarget_Port{Port: 22}}
	size := func(r, c uint32) *nodev1.TerminalSize { return &nodev1.TerminalSize{Rows: r, Cols: c} }
	for _, tc := range []struct {
		name  string
		open  *controlv1.TunnelOpen
		field string
	}{
		{"terminal on a port", &controlv1.TunnelOpen{NodeId: "node-1", Target: port, TerminalSize: size(24, 80)}, "open.terminal_size"},
		{"zero rows", &controlv1.TunnelOpen{NodeId: "node-1", Target: shell, TerminalSize: size(0, 80)}, "open.terminal_size"},
		{"zero cols", &controlv1.TunnelOpen{NodeId: "node-1", Target: shell, TerminalSize: size(24, 0)}, "open.terminal_size"},
		{"too wide", &controlv1.TunnelOpen{NodeId: "node-1", Target: shell, TerminalSize: size(24, 10001)}, "open.terminal_size"},
		{"too tall", &controlv1.TunnelOpen{NodeId: "node-1", Target: shell, TerminalSize: size(10001, 80)}, "open.terminal_size"},
		{"term without terminal", &controlv1.TunnelOpen{NodeId: "node-1", Target: shell, Term: "xterm"}, "open.term"},
		{"term on a port", &controlv1.TunnelOpen{NodeId: "node-1", Target: port, Term: "xterm"}, "open.term"},
		{"term with a space", &controlv1.TunnelOpen{NodeId: "node-1", Target: shell, TerminalSize: size(24, 80), Term: "xterm 256"}, "open.term"},
		{"term with a semicolon", &controlv1.TunnelOpen{NodeId: "node-1", Target: shell, TerminalSize: size(24, 80), Term: "xterm;id"}, "open.term"},
		{"term too long", &controlv1.TunnelOpen{NodeId: "node-1", Target: shell, TerminalSize: size(24, 80), Term: strings.Repeat("x", 65)}, "open.term"},
	} {
		err := openTunnelErr(ctx, b, &controlv1.OpenTunnelRequest{Open: tc.open})
		ce := requireConnectError(t, err, connect.CodeInvalidArgument, tc.name)
		require.True(t, strings.HasPrefix(ce.Message(), tc.field+":"), "%s: message %q should start with %q", tc.name, ce.Message(), tc.field+":")
	}
	require.Equal(t, before, b.rowCounts(), "invalid requests wrote rows")
	// The largest terminal passes validation (this api relays no tunnels).
	err := openTunnelErr(ctx, b, &controlv1.OpenTunnelRequest{Open: &controlv1.TunnelOpen{NodeId: "node-1", Target: shell,
		TerminalSize: size(10000, 10000), Term: "screen.xterm-256color+x_1"}})
	ce := requireConnectError(t, err, connect.CodeFailedPrecondition, "a valid terminal")
	require.Contains(t, ce.Message(), "--api.relay-token-file")
}
