package nodereg_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/nodereg"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestRegisterVerifyRevoke(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	cred, err := nodereg.Register(ctx, db, nodereg.Node{ID: "n1", SiteID: "s1"})
	require.NoError(t, err)
	require.Contains(t, cred, nodeauth.Prefix)

	id, err := nodereg.Verify(ctx, db, "n1", cred)
	require.NoError(t, err)
	require.Equal(t, nodereg.Identity{NodeID: "n1", Kind: "node", SiteID: "s1"}, id)

	// A second credential (rotation) works beside the first.
	cred2, err := nodereg.Register(ctx, db, nodereg.Node{ID: "n1"})
	require.NoError(t, err)
	_, err = nodereg.Verify(ctx, db, "n1", cred2)
	require.NoError(t, err)

	for name, c := range map[string][2]string{
		"wrong credential":  {"n1", nodeauth.Prefix + "nope"},
		"unknown node":      {"n2", cred},
		"bad node id":       {"n 1", cred},
		"empty credential":  {"n1", ""},
		"other node's cred": {"n1", "x" + cred},
	} {
		_, err := nodereg.Verify(ctx, db, c[0], c[1])
		require.ErrorIs(t, err, nodereg.ErrUnauthenticated, name)
	}

	require.NoError(t, nodereg.Revoke(ctx, db, "n1"))
	_, err = nodereg.Verify(ctx, db, "n1", cred)
	require.ErrorIs(t, err, nodereg.ErrUnauthenticated)

	_, err = nodereg.Register(ctx, db, nodereg.Node{ID: "bad id"})
	require.Error(t, err)
}

// TestCredentialInGraceIsLiveUntilItsRevokedAt: a credential whose
// revoked_at lies in the future (a rotation's grace) verifies until the
// database clock passes it, then fails; Revoke ends it at once.
func TestCredentialInGraceIsLiveUntilItsRevokedAt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	oldCred, err := nodereg.Register(ctx, db, nodereg.Node{ID: "n1"})
	require.NoError(t, err)
	newCred, err := nodereg.Register(ctx, db, nodereg.Node{ID: "n1"})
	require.NoError(t, err)

	// The old credential dies 1 s from now, by the database clock.
	var until time.Time
	require.NoError(t, db.QueryRow(ctx, `UPDATE node_credentials SET revoked_at = compute_now() + interval '1 second'
		WHERE node_id = 'n1' AND credential_hash = $1 RETURNING revoked_at`, nodeauth.Hash(oldCred)).Scan(&until))
	_, err = nodereg.Verify(ctx, db, "n1", oldCred)
	require.NoError(t, err, "a credential in its grace is live")
	// Wait on the database clock, not ours.
	require.Eventually(t, func() bool {
		now, err := pgdb.Now(ctx, db)
		return err == nil && now.After(until)
	}, 10*time.Second, 50*time.Millisecond)
	_, err = nodereg.Verify(ctx, db, "n1", oldCred)
	require.ErrorIs(t, err, nodereg.ErrUnauthenticated, "past its revoked_at")
	_, err = nodereg.Verify(ctx, db, "n1", newCred)
	require.NoError(t, err)

	// Revoke ends a credential in its grace at once, not at its revoked_at.
	third, err := nodereg.Register(ctx, db, nodereg.Node{ID: "n2"})
	require.NoError(t, err)
	_, err = db.Exec(ctx, `UPDATE node_credentials SET revoked_at = compute_now() + interval '1 hour' WHERE node_id = 'n2'`)
	require.NoError(t, err)
	_, err = nodereg.Verify(ctx, db, "n2", third)
	require.NoError(t, err)
	require.NoError(t, nodereg.Revoke(ctx, db, "n2"))
	var live int
	require.NoError(t, db.QueryRow(ctx, `SELECT count(*) FROM node_credentials WHERE node_id = 'n2' AND (revoked_at IS NULL OR revoked_at > compute_now())`).Scan(&live))
	require.Zero(t, live)
	// Revoke also stopped the node, so a fresh credential would not help.
	_, err = nodereg.Verify(ctx, db, "n2", third)
	require.ErrorIs(t, err, nodereg.ErrUnauthenticated)
}
