package nodeauth_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/pgdb"
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

// TestCredentialInGraceIsLiveUntilItsRevokedAt: a credential whose
// revoked_at lies in the future (a rotation's grace) verifies until the
// database clock passes it, then fails; Revoke ends it at once.
func TestCredentialInGraceIsLiveUntilItsRevokedAt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	oldCred, err := nodeauth.Register(ctx, db, nodeauth.Node{ID: "n1"})
	require.NoError(t, err)
	newCred, err := nodeauth.Register(ctx, db, nodeauth.Node{ID: "n1"})
	require.NoError(t, err)

	// The old credential dies 1 s from now, by the database clock.
	var until time.Time
	require.NoError(t, db.QueryRow(ctx, `UPDATE node_credentials SET revoked_at = compute_now() + interval '1 second'
		WHERE node_id = 'n1' AND credential_hash = $1 RETURNING revoked_at`, nodeauth.Hash(oldCred)).Scan(&until))
	_, err = nodeauth.Verify(ctx, db, "n1", oldCred)
	require.NoError(t, err, "a credential in its grace is live")
	// Wait on the database clock, not ours.
	require.Eventually(t, func() bool {
		now, err := pgdb.Now(ctx, db)
		return err == nil && now.After(until)
	}, 10*time.Second, 50*time.Millisecond)
	_, err = nodeauth.Verify(ctx, db, "n1", oldCred)
	require.ErrorIs(t, err, nodeauth.ErrUnauthenticated, "past its revoked_at")
	_, err = nodeauth.Verify(ctx, db, "n1", newCred)
	require.NoError(t, err)

	// Revoke ends a credential in its grace at once, not at its revoked_at.
	third, err := nodeauth.Register(ctx, db, nodeauth.Node{ID: "n2"})
	require.NoError(t, err)
	_, err = db.Exec(ctx, `UPDATE node_credentials SET revoked_at = compute_now() + interval '1 hour' WHERE node_id = 'n2'`)
	require.NoError(t, err)
	_, err = nodeauth.Verify(ctx, db, "n2", third)
	require.NoError(t, err)
	require.NoError(t, nodeauth.Revoke(ctx, db, "n2"))
	var live int
	require.NoError(t, db.QueryRow(ctx, `SELECT count(*) FROM node_credentials WHERE node_id = 'n2' AND (revoked_at IS NULL OR revoked_at > compute_now())`).Scan(&live))
	require.Zero(t, live)
	// Revoke also stopped the node, so a fresh credential would not help.
	_, err = nodeauth.Verify(ctx, db, "n2", third)
	require.ErrorIs(t, err, nodeauth.ErrUnauthenticated)
}
