package nodeauth_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestRegisterVerifyRevoke(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	cred, err := nodeauth.Register(ctx, db, nodeauth.Node{ID: "n1", SiteID: "s1"})
	require.NoError(t, err)
	require.Contains(t, cred, nodeauth.Prefix)

	id, err := nodeauth.Verify(ctx, db, "n1", cred)
	require.NoError(t, err)
	require.Equal(t, nodeauth.Identity{NodeID: "n1", Kind: "node", SiteID: "s1"}, id)

	// A second credential (rotation) works beside the first.
	cred2, err := nodeauth.Register(ctx, db, nodeauth.Node{ID: "n1"})
	require.NoError(t, err)
	_, err = nodeauth.Verify(ctx, db, "n1", cred2)
	require.NoError(t, err)

	for name, c := range map[string][2]string{
		"wrong credential":  {"n1", nodeauth.Prefix + "nope"},
		"unknown node":      {"n2", cred},
		"bad node id":       {"n 1", cred},
		"empty credential":  {"n1", ""},
		"other node's cred": {"n1", "x" + cred},
	} {
		_, err := nodeauth.Verify(ctx, db, c[0], c[1])
		require.ErrorIs(t, err, nodeauth.ErrUnauthenticated, name)
	}

	require.NoError(t, nodeauth.Revoke(ctx, db, "n1"))
	_, err = nodeauth.Verify(ctx, db, "n1", cred)
	require.ErrorIs(t, err, nodeauth.ErrUnauthenticated)

	_, err = nodeauth.Register(ctx, db, nodeauth.Node{ID: "bad id"})
	require.Error(t, err)
}
