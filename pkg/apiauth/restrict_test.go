package apiauth

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestLenientParseAndRestrict: a file that does not parse still yields its
// valid lines, and restricting the keyring in force to them takes away
// removed tokens and lowers demoted roles, never adding or raising one.
func TestLenientParseAndRestrict(t *testing.T) {
	t.Parallel()
	old, err := LoadContents("old", []byte("admin:aaaaaaaaaaaaaaaa\noperator:bbbbbbbbbbbbbbbb\nviewer:cccccccccccccccc\n"), "", "")
	require.NoError(t, err)
	edited := []byte("viewer:aaaaaaaaaaaaaaaa\nadmin:cccccccccccccccc\noperator:dddddddddddddddd\nbogus line\n")
	_, err = LoadContents("new", edited, "", "")
	require.Error(t, err)
	lenient, errs := LoadContentsLenient("new", edited, "", "")
	require.Len(t, errs, 1)
	require.ErrorContains(t, errs[0], "new line 4")
	require.Equal(t, 3, lenient.Len())

	kept := old.Restrict(lenient)
	require.Equal(t, 2, kept.Len())
	id, ok := kept.Authenticate("aaaaaaaaaaaaaaaa")
	require.True(t, ok)
	require.Equal(t, RoleViewer, id.Role, "demoted")
	_, ok = kept.Authenticate("bbbbbbbbbbbbbbbb")
	require.False(t, ok, "removed")
	id, ok = kept.Authenticate("cccccccccccccccc")
	require.True(t, ok)
	require.Equal(t, RoleViewer, id.Role, "not promoted")
	_, ok = kept.Authenticate("dddddddddddddddd")
	require.False(t, ok, "not added")
	require.True(t, kept.Equal(kept.Restrict(lenient)))
	require.False(t, kept.Equal(old))
}
