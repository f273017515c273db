package e2e

import (
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/fleettest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

// TestSecondNodeAgentOnOneStateDirIsRefused: two leasehold-node processes
// given one --state-dir would interleave their journals (a command could
// run twice); the second exits 1 naming the flag, and the first keeps
// running. No gateway is needed: the journal is opened before any dial.
func TestSecondNodeAgentOnOneStateDirIsRefused(t *testing.T) {
	t.Parallel()
	state := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(state, "credential"), []byte("lhn_0123456789abcdef0123456789abcdef0123456789a\n"), 0o600))
	bin := fleettest.Binary(t, "node")
	args := func() []string {
		return []string{"--gateway-url", "http://" + fleettest.Addr(t), "--state-dir", state, "--node-id", "shared-state",
			"--http-addr", fleettest.Addr(t), "--log-format", "text"}
	}
	first := proctest.Start(t, "first", bin, nil, args()...)
	// /livez answers once the agent is built, its journal open and locked.
	require.NoError(t, first.AwaitStatus(t.Context(), "/livez", http.StatusOK, time.Minute), first.Logs())

	second := proctest.Start(t, "second", bin, nil, args()...)
	require.Equal(t, 1, second.Wait(time.Minute), second.Logs())
	require.Contains(t, second.Logs(), "--state-dir "+state+": another leasehold-node uses it")
	require.False(t, first.Exited(), "the first agent keeps running")
}
