package apiauth

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const (
	adminTok    = "admin-token-0123456789"
	operatorTok = "operator-token-0123456789"
	viewerTok   = "viewer-token-0123456789"
)

func TestParseAndAuthenticate(t *testing.T) {
	t.Parallel()
	k, err := Parse("test", strings.NewReader(`
# comment
admin:`+adminTok+`
operator:`+HashToken(operatorTok)+`
viewer:`+viewerTok+`, viewer:`+HashToken("another-viewer-token-xyz")+`
`))
	require.NoError(t, err)
	require.Equal(t, 4, k.Len())

	for tok, want := range map[string]Role{adminTok: RoleAdmin, operatorTok: RoleOperator, viewerTok: RoleViewer, "another-viewer-token-xyz": RoleViewer} {
		id, ok := k.Authenticate(tok)
		require.True(t, ok, tok)
		require.Equal(t, want, id.Role)
		require.True(t, strings.HasPrefix(id.ID, "sha256:"))
		require.NotContains(t, id.ID, tok)
	}
	for _, bad := range []string{"", "nope", adminTok + "x", strings.Repeat("a", MaxTokenLen+1)} {
		_, ok := k.Authenticate(bad)
		require.False(t, ok, bad)
	}
	var empty *Keyring
	_, ok := empty.Authenticate(adminTok)
	require.False(t, ok)
}

func TestParseErrorsNeverShowTokens(t *testing.T) {
	t.Parallel()
	secret := "supersecret-token-value-123"
	for _, in := range []string{
		"root:" + secret,
		secret,
		"admin:short",
		"admin:sha256:zz",
		"admin:" + secret + " with space",
		"admin:" + secret + "\nviewer:" + secret,
	} {
		_, err := Parse("src", strings.NewReader(in))
		require.Error(t, err, in)
		require.NotContains(t, err.Error(), secret)
		require.Contains(t, err.Error(), "src line")
	}
}

func TestLoadFileAndInline(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "tokens")
	require.NoError(t, os.WriteFile(path, []byte("admin:"+adminTok+"\n"), 0o600))
	k, err := Load(path, "viewer:"+viewerTok, "LEASEHOLD_API_TOKENS")
	require.NoError(t, err)
	require.Equal(t, 2, k.Len())
	_, err = Load(path, "viewer:"+adminTok, "LEASEHOLD_API_TOKENS")
	require.ErrorContains(t, err, "configured twice")
	_, err = Load(filepath.Join(t.TempDir(), "missing"), "", "")
	require.Error(t, err)
}

func TestRoleOrder(t *testing.T) {
	t.Parallel()
	require.True(t, RoleAdmin.Allows(RoleOperator))
	require.True(t, RoleOperator.Allows(RoleViewer))
	require.False(t, RoleViewer.Allows(RoleOperator))
	require.False(t, RoleNone.Allows(RoleNone))
}

func TestBearerToken(t *testing.T) {
	t.Parallel()
	tok, ok := BearerToken("Bearer abc")
	require.True(t, ok)
	require.Equal(t, "abc", tok)
	tok, ok = BearerToken("bearer  abc ")
	require.True(t, ok)
	require.Equal(t, "abc", tok)
	for _, h := range []string{"", "Bearer", "Bearer ", "Basic abc", "abc"} {
		_, ok := BearerToken(h)
		require.False(t, ok, h)
	}
}

func TestGenerateTokenIsAcceptedAndUnique(t *testing.T) {
	t.Parallel()
	seen := map[string]bool{}
	for range 100 {
		tok, err := GenerateToken()
		require.NoError(t, err)
		require.True(t, strings.HasPrefix(tok, TokenPrefix))
		require.Len(t, tok, len(TokenPrefix)+43)
		require.False(t, seen[tok], "a token repeated")
		seen[tok] = true
		// Both forms configure it: in clear and hashed.
		for _, line := range []string{"operator:" + tok, ConfigLine(RoleOperator, tok)} {
			k, err := Parse("test", strings.NewReader(line))
			require.NoError(t, err, line)
			id, ok := k.Authenticate(tok)
			require.True(t, ok)
			require.Equal(t, RoleOperator, id.Role)
		}
	}
}
