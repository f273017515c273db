package nodeauth

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestWellFormed: an issued credential is well formed; a shorter or longer
// one, another prefix, or a character outside base64url is not.
func TestWellFormed(t *testing.T) {
	t.Parallel()
	c, err := NewCredential()
	require.NoError(t, err)
	require.True(t, WellFormed(c), c)
	for _, bad := range []string{"", Prefix, c[:len(c)-1], c + "A", "lhx_" + c[4:], c[:10] + "+" + c[11:], c[:10] + "=" + c[11:], c[:10] + "\x00" + c[11:]} {
		require.False(t, WellFormed(bad), "%q", bad)
	}
}
