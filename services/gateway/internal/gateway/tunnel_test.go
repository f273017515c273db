package gateway

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	relayv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/relay/v1"
)

// TestTunnelRelayOpenTerminal: the relay takes a terminal size (1..10000
// rows and cols) and a TERM of [A-Za-z0-9._+-] only for a shell, and names
// the field it refuses.
func TestTunnelRelayOpenTerminal(t *testing.T) {
	t.Parallel()
	shell := &controlv1.TunnelTarget{Kind: &controlv1.TunnelTarget_Shell{Shell: true}}
	port := &controlv1.TunnelTarget{Kind: &controlv1.TunnelTarget_Port{Port: 22}}
	size := func(r, c uint32) *nodev1.TerminalSize { return &nodev1.TerminalSize{Rows: r, Cols: c} }
	for _, tc := range []struct {
		open  *relayv1.RelayOpen
		field string // "" when valid
	}{
		{&relayv1.RelayOpen{NodeId: "n1", Target: shell}, ""},
		{&relayv1.RelayOpen{NodeId: "n1", Target: shell, TerminalSize: size(40, 132), Term: "xterm-256color"}, ""},
		{&relayv1.RelayOpen{NodeId: "n1", Target: shell, TerminalSize: size(10000, 1)}, ""},
		{&relayv1.RelayOpen{NodeId: "n1", Target: shell, TerminalSize: size(0, 80)}, "open.terminal_size:"},
		{&relayv1.RelayOpen{NodeId: "n1", Target: shell, TerminalSize: size(24, 10001)}, "open.terminal_size:"},
		{&relayv1.RelayOpen{NodeId: "n1", Target: port, TerminalSize: size(24, 80)}, "open.terminal_size:"},
		{&relayv1.RelayOpen{NodeId: "n1", Target: shell, Term: "xterm"}, "open.term:"},
		{&relayv1.RelayOpen{NodeId: "n1", Target: shell, TerminalSize: size(24, 80), Term: "x;rm -rf"}, "open.term:"},
		{&relayv1.RelayOpen{NodeId: "n1", Target: shell, TerminalSize: size(24, 80), Term: strings.Repeat("x", 65)}, "open.term:"},
	} {
		err := validateRelayOpen(tc.open)
		if tc.field == "" {
			require.NoError(t, err, "%v", tc.open)
			continue
		}
		require.Error(t, err, "%v", tc.open)
		require.True(t, strings.HasPrefix(err.Error(), tc.field), "%v: %q names %s", tc.open, err, tc.field)
	}
}
