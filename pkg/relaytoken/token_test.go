package relaytoken_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/jonboulle/clockwork"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/relaytoken"
	"github.com/leasehold/leasehold/pkg/reload"
)

// TestTokenFollowsItsFile: a Token authorizes the file's token, takes a
// rewritten one on the next check, and keeps the one in force when the
// file's new content is too short; a file too short at start is refused
// naming the flag.
func TestTokenFollowsItsFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "relay-token")
	require.NoError(t, os.WriteFile(path, []byte("  first-token-0123456789\n"), 0o600))
	tok, err := relaytoken.Watch("test-relay-token", "--relay-token-file", path, reload.Options{Clock: clockwork.NewFakeClock()})
	require.NoError(t, err)
	require.Equal(t, "first-token-0123456789", tok.Value())
	require.True(t, tok.Authorizes("Bearer first-token-0123456789"))
	require.False(t, tok.Authorizes("Bearer first-token-012345678"))
	require.False(t, tok.Authorizes("first-token-0123456789"), "the Bearer scheme is required")

	require.NoError(t, os.WriteFile(path, []byte("second-token-0123456789"), 0o600))
	require.NoError(t, tok.Check())
	require.True(t, tok.Authorizes("Bearer second-token-0123456789"))
	require.False(t, tok.Authorizes("Bearer first-token-0123456789"), "the rotated-out token is refused")

	require.NoError(t, os.WriteFile(path, []byte("short"), 0o600))
	require.ErrorContains(t, tok.Check(), "at least 16 characters")
	require.True(t, tok.Authorizes("Bearer second-token-0123456789"), "a bad version keeps the token in force")

	_, err = relaytoken.Watch("test-relay-token-2", "--relay-token-file", path, reload.Options{})
	require.ErrorContains(t, err, "--relay-token-file")
}
