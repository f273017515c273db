package api

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	enrollv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/enroll/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/enroll/v1/enrollv1connect"
	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/nodereg"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// enroll is an EnrollmentService client without any bearer token, as a
// machine that joins has none.
func (b *bundle) enroll() enrollv1connect.EnrollmentServiceClient {
	return enrollv1connect.NewEnrollmentServiceClient(b.http, b.base)
}

// joinToken creates a join token as admin and returns it.
func (b *bundle) joinToken(req *controlv1.CreateJoinTokenRequest) (string, *controlv1.JoinToken) {
	b.t.Helper()
	resp, err := b.admin.CreateJoinToken(ctxT(b.t), connect.NewRequest(req))
	require.NoError(b.t, err)
	b.secret(resp.Msg.GetToken())
	return resp.Msg.GetToken(), resp.Msg.GetJoinToken()
}

func (b *bundle) join(token, nodeID string, labels map[string]string) (*enrollv1.JoinResponse, error) {
	b.t.Helper()
	resp, err := b.enroll().Join(ctxT(b.t), connect.NewRequest(&enrollv1.JoinRequest{Token: token, NodeId: nodeID,
		Hostname: nodeID + ".example", Labels: labels}))
	if err != nil {
		return nil, err
	}
	b.secret(resp.Msg.GetCredential())
	return resp.Msg, nil
}

// waitDBPast waits until the database clock is past t.
func (b *bundle) waitDBPast(t time.Time) {
	b.t.Helper()
	require.Eventually(b.t, func() bool {
		now, err := pgdb.Now(ctxT(b.t), b.db.Pool)
		return err == nil && now.After(t)
	}, 10*time.Second, 20*time.Millisecond)
}

func (b *bundle) verify(nodeID, cred string) error {
	b.t.Helper()
	_, err := nodereg.Verify(ctxT(b.t), b.db.Pool, nodeID, cred)
	return err
}

func TestJoinWithOneUseTokenOnceThenUsedUp(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	_, err := b.admin.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: "gpu"}))
	require.NoError(t, err)
	token, jt := b.joinToken(&controlv1.CreateJoinTokenRequest{Labels: map[string]string{"zone": "a"}, PoolId: "gpu",
		Description: "rack 7"})
	require.Regexp(t, `^lhj_[0-9a-f]{16}\.[A-Za-z0-9_-]{43}$`, token)
	require.True(t, strings.HasPrefix(token, "lhj_"+jt.GetId()+"."))
	require.EqualValues(t, 1, jt.GetMaxUses(), "max_uses defaults to 1")
	require.Equal(t, 24*time.Hour, jt.GetExpiresAt().AsTime().Sub(jt.GetCreatedAt().AsTime()).Round(time.Second), "ttl defaults to 24h")
	// Only the token's SHA-256 is stored.
	var hash []byte
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT secret_hash FROM join_tokens WHERE id = $1`, jt.GetId()).Scan(&hash))
	require.Equal(t, hashJoinToken(token), hash)
	require.Zero(t, b.count(`SELECT count(*) FROM join_tokens j WHERE j::text LIKE '%' || $1 || '%'`, strings.SplitN(token, ".", 2)[1]))

	resp, err := b.join(token, "node-1", map[string]string{"zone": "b", "rack": "r7"})
	require.NoError(t, err)
	require.Equal(t, "node-1", resp.GetNodeId())
	require.False(t, resp.GetReenrolled())
	require.True(t, strings.HasPrefix(resp.GetCredential(), nodeauth.Prefix))

	// The gateway authenticates the joined node.
	id, err := nodereg.Verify(ctx, b.db.Pool, "node-1", resp.GetCredential())
	require.NoError(t, err)
	require.Equal(t, nodereg.Identity{NodeID: "node-1", Kind: "node"}, id)
	// The token's labels win over the machine's; the token's pool.
	got, err := b.viewer.GetNode(ctx, connect.NewRequest(&controlv1.GetNodeRequest{NodeId: "node-1"}))
	require.NoError(t, err)
	require.Equal(t, map[string]string{"zone": "a", "rack": "r7"}, got.Msg.GetNode().GetLabels())
	require.Equal(t, "gpu", got.Msg.GetNode().GetPoolId())
	require.Equal(t, 1, b.count(`SELECT uses FROM join_tokens WHERE id = $1`, jt.GetId()))

	// One audit row, by the token's id, without the secret.
	var actor, role, detail string
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT actor, role, detail::text FROM audit_events WHERE method = 'Join' AND target_id = 'node-1'`).
		Scan(&actor, &role, &detail))
	require.Equal(t, "join-token:"+jt.GetId(), actor)
	require.Equal(t, "join-token", role)
	require.Contains(t, detail, "node-1.example")
	require.Zero(t, b.count(`SELECT count(*) FROM audit_events a WHERE a::text LIKE '%' || $1 || '%'`, strings.SplitN(token, ".", 2)[1]))

	// The second join is refused and writes nothing.
	before := b.rowCounts()
	_, err = b.join(token, "node-2", nil)
	ce := requireConnectError(t, err, connect.CodeUnauthenticated)
	require.Contains(t, ce.Message(), "join token used up: 1 of 1 uses")
	require.Equal(t, before, b.rowCounts())
	require.Equal(t, 1, b.count(`SELECT uses FROM join_tokens WHERE id = $1`, jt.GetId()))
}

// TestJoinTokenUsesAreCountedUnderConcurrency: a 3-use token raced by 8
// machines enrolls exactly 3 of them.
func TestJoinTokenUsesAreCountedUnderConcurrency(t *testing.T) {
	t.Parallel()
	b := setup(t)
	token, jt := b.joinToken(&controlv1.CreateJoinTokenRequest{MaxUses: 3})
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		ok, used int
	)
	for i := range 8 {
		wg.Go(func() {
			_, err := b.join(token, fmt.Sprintf("race-%d", i), nil)
			mu.Lock()
			defer mu.Unlock()
			if err == nil {
				ok++
			} else if connect.CodeOf(err) == connect.CodeUnauthenticated && strings.Contains(err.Error(), "used up: 3 of 3") {
				used++
			}
		})
	}
	wg.Wait()
	require.Equal(t, 3, ok)
	require.Equal(t, 5, used)
	require.Equal(t, 3, b.count(`SELECT count(*) FROM nodes`))
	require.Equal(t, 3, b.count(`SELECT uses FROM join_tokens WHERE id = $1`, jt.GetId()))
}

func TestJoinRefusesExpiredRevokedAndUnknownTokens(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)

	// Expired: by the database clock. The shortest ttl is a minute, so the
	// test moves the token's times into the past instead of waiting.
	expired, ej := b.joinToken(&controlv1.CreateJoinTokenRequest{})
	var expiresAt time.Time
	require.NoError(t, b.db.Pool.QueryRow(ctx, `UPDATE join_tokens SET created_at = compute_now() - interval '2 minutes',
		expires_at = compute_now() - interval '1 minute' WHERE id = $1 RETURNING expires_at`, ej.GetId()).Scan(&expiresAt))

	revoked, rj := b.joinToken(&controlv1.CreateJoinTokenRequest{MaxUses: 5})
	rv, err := b.admin.RevokeJoinToken(ctx, connect.NewRequest(&controlv1.RevokeJoinTokenRequest{Id: rj.GetId()}))
	require.NoError(t, err)
	require.NotNil(t, rv.Msg.GetJoinToken().GetRevokedAt())
	// Revoking twice is not an error, and keeps the first time.
	rv2, err := b.admin.RevokeJoinToken(ctx, connect.NewRequest(&controlv1.RevokeJoinTokenRequest{Id: rj.GetId()}))
	require.NoError(t, err)
	require.Equal(t, rv.Msg.GetJoinToken().GetRevokedAt().AsTime(), rv2.Msg.GetJoinToken().GetRevokedAt().AsTime())
	require.Equal(t, 1, b.count(`SELECT count(*) FROM audit_events WHERE method = 'RevokeJoinToken' AND outcome = 'unchanged'`))
	_, err = b.admin.RevokeJoinToken(ctx, connect.NewRequest(&controlv1.RevokeJoinTokenRequest{Id: "0123456789abcdef"}))
	requireCode(t, err, connect.CodeNotFound)

	good, gj := b.joinToken(&controlv1.CreateJoinTokenRequest{})
	wrongSecret := "lhj_" + gj.GetId() + "." + strings.Repeat("A", 43)
	b.secret(wrongSecret)

	before := b.rowCounts()
	for name, c := range map[string]struct{ token, msg string }{
		"expired":       {expired, "join token expired at " + expiresAt.UTC().Format(time.RFC3339)},
		"revoked":       {revoked, "join token revoked"},
		"unknown id":    {"lhj_0123456789abcdef." + strings.Repeat("B", 43), "join token unknown"},
		"wrong secret":  {wrongSecret, "join token unknown"},
		"malformed":     {"lhj_nope", "join token unknown"},
		"node cred":     {nodeauth.Prefix + strings.Repeat("C", 43), "join token unknown"},
		"api token":     {adminToken, "join token unknown"},
		"longer secret": {good + "x", "join token unknown"},
	} {
		_, err := b.join(c.token, "node-"+strings.ReplaceAll(name, " ", "-"), nil)
		ce := requireConnectError(t, err, connect.CodeUnauthenticated, name)
		require.Contains(t, ce.Message(), c.msg, name)
	}
	require.Equal(t, before, b.rowCounts(), "a refused join writes nothing")
	require.Zero(t, b.count(`SELECT coalesce(sum(uses), 0) FROM join_tokens`))

	// The good one still works.
	_, err = b.join(good, "node-ok", nil)
	require.NoError(t, err)
}

func TestJoinInvalidArgumentsWriteNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	token, jt := b.joinToken(&controlv1.CreateJoinTokenRequest{MaxUses: 10})
	before := b.rowCounts()
	for _, c := range []struct {
		field string
		req   *enrollv1.JoinRequest
	}{
		{"node_id", &enrollv1.JoinRequest{Token: token, NodeId: "bad id"}},
		{"node_id", &enrollv1.JoinRequest{Token: token}},
		{"node_id", &enrollv1.JoinRequest{Token: token, NodeId: strings.Repeat("n", 201)}},
		{"token", &enrollv1.JoinRequest{NodeId: "node-1"}},
		{"labels", &enrollv1.JoinRequest{Token: token, NodeId: "node-1", Labels: map[string]string{"bad key!": "x"}}},
		{"labels[k]", &enrollv1.JoinRequest{Token: token, NodeId: "node-1", Labels: map[string]string{"k": "a\x01b"}}},
		{"hostname", &enrollv1.JoinRequest{Token: token, NodeId: "node-1", Hostname: strings.Repeat("h", 256)}},
		{"hostname", &enrollv1.JoinRequest{Token: token, NodeId: "node-1", Hostname: "h\x00"}},
	} {
		_, err := b.enroll().Join(ctxT(t), connect.NewRequest(c.req))
		ce := requireConnectError(t, err, connect.CodeInvalidArgument, c.field)
		require.True(t, strings.HasPrefix(ce.Message(), c.field+":"), "%q names %s", ce.Message(), c.field)
	}
	require.Equal(t, before, b.rowCounts())
	require.Zero(t, b.count(`SELECT uses FROM join_tokens WHERE id = $1`, jt.GetId()))
}

func TestJoinExistingNodeNeedsReenroll(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	oldCred := b.registerNode("node-1", map[string]string{"role": "db"})
	b.exec(`INSERT INTO node_sessions (node_id, gateway_id, session_expires_at) VALUES ('node-1', 'gw-1', compute_now() + interval '40 seconds')`)
	token, jt := b.joinToken(&controlv1.CreateJoinTokenRequest{MaxUses: 5})

	before := b.rowCounts()
	_, err := b.join(token, "node-1", nil)
	ce := requireConnectError(t, err, connect.CodeAlreadyExists)
	require.Equal(t, "node node-1 exists; an admin must allow it to re-enroll (AllowReenroll)", ce.Message())
	require.Equal(t, before, b.rowCounts())

	// An admin allows it for an hour (the default) by the database clock.
	dbNow, err := pgdb.Now(ctx, b.db.Pool)
	require.NoError(t, err)
	al, err := b.admin.AllowReenroll(ctx, connect.NewRequest(&controlv1.AllowReenrollRequest{NodeId: "node-1", Reason: "re-imaged"}))
	require.NoError(t, err)
	require.WithinDuration(t, dbNow.Add(time.Hour), al.Msg.GetUntil().AsTime(), 5*time.Second)
	require.Equal(t, "node-1", al.Msg.GetNode().GetId())
	require.Equal(t, 1, b.count(`SELECT count(*) FROM audit_events WHERE method = 'AllowReenroll' AND target_id = 'node-1' AND detail->>'reason' = 're-imaged'`))

	resp, err := b.join(token, "node-1", map[string]string{"zone": "c"})
	require.NoError(t, err)
	require.True(t, resp.GetReenrolled())
	// The old credential is dead, the new one works; the session is closed;
	// the window is used up; the node keeps its assigned labels.
	require.ErrorIs(t, b.verify("node-1", oldCred), nodereg.ErrUnauthenticated)
	require.NoError(t, b.verify("node-1", resp.GetCredential()))
	require.Zero(t, b.count(`SELECT count(*) FROM node_sessions WHERE node_id = 'node-1' AND state = 'connected'`))
	require.Zero(t, b.count(`SELECT count(*) FROM nodes WHERE id = 'node-1' AND reenroll_until IS NOT NULL`))
	require.Equal(t, 1, b.count(`SELECT count(*) FROM nodes WHERE id = 'node-1' AND spec->'labels'->>'role' = 'db'`))
	require.Equal(t, 1, b.count(`SELECT uses FROM join_tokens WHERE id = $1`, jt.GetId()))

	// Once only: a second join needs another AllowReenroll.
	_, err = b.join(token, "node-1", nil)
	requireCode(t, err, connect.CodeAlreadyExists)
	// A window that has passed (by the database clock) allows nothing.
	b.exec(`UPDATE nodes SET reenroll_until = compute_now() - interval '1 second' WHERE id = 'node-1'`)
	_, err = b.join(token, "node-1", nil)
	requireCode(t, err, connect.CodeAlreadyExists)

	// A revoked node can be neither allowed nor joined.
	_, err = b.admin.RevokeNode(ctx, connect.NewRequest(&controlv1.RevokeNodeRequest{NodeId: "node-1"}))
	require.NoError(t, err)
	_, err = b.admin.AllowReenroll(ctx, connect.NewRequest(&controlv1.AllowReenrollRequest{NodeId: "node-1"}))
	requireCode(t, err, connect.CodeFailedPrecondition)
	b.exec(`UPDATE nodes SET reenroll_until = compute_now() + interval '1 hour' WHERE id = 'node-1'`)
	before = b.rowCounts()
	_, err = b.join(token, "node-1", nil)
	requireCode(t, err, connect.CodeFailedPrecondition)
	require.Equal(t, before, b.rowCounts())

	for _, c := range []struct {
		field string
		req   *controlv1.AllowReenrollRequest
	}{
		{"node_id", &controlv1.AllowReenrollRequest{NodeId: "bad id"}},
		{"ttl", &controlv1.AllowReenrollRequest{NodeId: "node-1", Ttl: durationpb.New(30 * time.Second)}},
		{"ttl", &controlv1.AllowReenrollRequest{NodeId: "node-1", Ttl: durationpb.New(8 * 24 * time.Hour)}},
		{"reason", &controlv1.AllowReenrollRequest{NodeId: "node-1", Reason: strings.Repeat("r", 201)}},
	} {
		_, err := b.admin.AllowReenroll(ctx, connect.NewRequest(c.req))
		ce := requireConnectError(t, err, connect.CodeInvalidArgument, c.field)
		require.True(t, strings.HasPrefix(ce.Message(), c.field+":"), ce.Message())
	}
	_, err = b.admin.AllowReenroll(ctx, connect.NewRequest(&controlv1.AllowReenrollRequest{NodeId: "ghost"}))
	requireCode(t, err, connect.CodeNotFound)
}

func TestRotateCredentialGraceThenOldOneFails(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	token, _ := b.joinToken(&controlv1.CreateJoinTokenRequest{})
	joined, err := b.join(token, "node-1", nil)
	require.NoError(t, err)
	oldCred := joined.GetCredential()

	rot, err := b.enroll().RotateCredential(ctx, connect.NewRequest(&enrollv1.RotateCredentialRequest{
		NodeId: "node-1", Credential: oldCred, Grace: durationpb.New(1500 * time.Millisecond)}))
	require.NoError(t, err)
	newCred := rot.Msg.GetCredential()
	b.secret(newCred)
	require.NotEqual(t, oldCred, newCred)
	until := rot.Msg.GetOldValidUntil().AsTime()
	// Stored exactly: the old credential's revoked_at is old_valid_until.
	var stored time.Time
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT revoked_at FROM node_credentials WHERE credential_hash = $1`, nodeauth.Hash(oldCred)).Scan(&stored))
	require.True(t, stored.Equal(until), "%s vs %s", stored, until)
	require.Equal(t, 1, b.count(`SELECT count(*) FROM audit_events WHERE method = 'RotateCredential' AND actor = 'node:node-1' AND role = 'node'`))

	// During the grace both work; rotating again with the old one does not
	// extend its life.
	require.NoError(t, b.verify("node-1", oldCred))
	require.NoError(t, b.verify("node-1", newCred))
	again, err := b.enroll().RotateCredential(ctx, connect.NewRequest(&enrollv1.RotateCredentialRequest{
		NodeId: "node-1", Credential: oldCred, Grace: durationpb.New(time.Hour)}))
	require.NoError(t, err)
	b.secret(again.Msg.GetCredential())
	require.True(t, again.Msg.GetOldValidUntil().AsTime().Equal(until), "a credential in its grace cannot extend itself")

	b.waitDBPast(until)
	require.ErrorIs(t, b.verify("node-1", oldCred), nodereg.ErrUnauthenticated)
	require.NoError(t, b.verify("node-1", newCred))
	_, err = b.enroll().RotateCredential(ctx, connect.NewRequest(&enrollv1.RotateCredentialRequest{NodeId: "node-1", Credential: oldCred}))
	requireCode(t, err, connect.CodeUnauthenticated)

	// The default grace is 10 minutes of the database clock.
	dbNow, err := pgdb.Now(ctx, b.db.Pool)
	require.NoError(t, err)
	def, err := b.enroll().RotateCredential(ctx, connect.NewRequest(&enrollv1.RotateCredentialRequest{NodeId: "node-1", Credential: newCred}))
	require.NoError(t, err)
	b.secret(def.Msg.GetCredential())
	require.WithinDuration(t, dbNow.Add(10*time.Minute), def.Msg.GetOldValidUntil().AsTime(), 5*time.Second)

	// Bad input: nothing written.
	before := b.rowCounts()
	for _, c := range []struct {
		code connect.Code
		req  *enrollv1.RotateCredentialRequest
	}{
		{connect.CodeInvalidArgument, &enrollv1.RotateCredentialRequest{NodeId: "node-1", Credential: newCred, Grace: durationpb.New(25 * time.Hour)}},
		{connect.CodeInvalidArgument, &enrollv1.RotateCredentialRequest{NodeId: "node-1", Credential: newCred, Grace: durationpb.New(-time.Second)}},
		{connect.CodeUnauthenticated, &enrollv1.RotateCredentialRequest{NodeId: "node-1", Credential: nodeauth.Prefix + "nope"}},
		{connect.CodeUnauthenticated, &enrollv1.RotateCredentialRequest{NodeId: "ghost", Credential: newCred}},
		{connect.CodeUnauthenticated, &enrollv1.RotateCredentialRequest{NodeId: "bad id", Credential: newCred}},
		{connect.CodeUnauthenticated, &enrollv1.RotateCredentialRequest{NodeId: "node-1"}},
	} {
		_, err := b.enroll().RotateCredential(ctx, connect.NewRequest(c.req))
		requireCode(t, err, c.code, c.req.String())
	}
	require.Equal(t, before, b.rowCounts())

	// RevokeNode ends credentials in their grace at once, and a revoked
	// node cannot rotate.
	_, err = b.admin.RevokeNode(ctx, connect.NewRequest(&controlv1.RevokeNodeRequest{NodeId: "node-1"}))
	require.NoError(t, err)
	require.Zero(t, b.count(`SELECT count(*) FROM node_credentials WHERE node_id = 'node-1' AND (revoked_at IS NULL OR revoked_at > compute_now())`))
	_, err = b.enroll().RotateCredential(ctx, connect.NewRequest(&enrollv1.RotateCredentialRequest{NodeId: "node-1", Credential: def.Msg.GetCredential()}))
	requireCode(t, err, connect.CodeUnauthenticated)
}

// TestRotateCredentialBoundsLiveCredentials: rotating in a loop with a
// long grace stops at maxLiveCredentials live ones.
func TestRotateCredentialBoundsLiveCredentials(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	cred := b.registerNode("node-1", nil)
	for range maxLiveCredentials - 1 {
		rot, err := b.enroll().RotateCredential(ctx, connect.NewRequest(&enrollv1.RotateCredentialRequest{NodeId: "node-1", Credential: cred}))
		require.NoError(t, err)
		cred = rot.Msg.GetCredential()
		b.secret(cred)
	}
	require.Equal(t, maxLiveCredentials, b.count(`SELECT count(*) FROM node_credentials WHERE node_id = 'node-1'`))
	_, err := b.enroll().RotateCredential(ctx, connect.NewRequest(&enrollv1.RotateCredentialRequest{NodeId: "node-1", Credential: cred}))
	requireCode(t, err, connect.CodeResourceExhausted)
	// A rotation without grace does not add one.
	rot, err := b.enroll().RotateCredential(ctx, connect.NewRequest(&enrollv1.RotateCredentialRequest{NodeId: "node-1", Credential: cred,
		Grace: durationpb.New(0)}))
	require.NoError(t, err)
	b.secret(rot.Msg.GetCredential())
	require.ErrorIs(t, b.verify("node-1", cred), nodereg.ErrUnauthenticated)
}

func TestJoinTokenRPCsNeedAdmin(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	calls := map[string]func(controlv1connect.ControlServiceClient) error{
		"CreateJoinToken": func(c controlv1connect.ControlServiceClient) error {
			_, err := c.CreateJoinToken(ctx, connect.NewRequest(&controlv1.CreateJoinTokenRequest{}))
			return err
		},
		"ListJoinTokens": func(c controlv1connect.ControlServiceClient) error {
			_, err := c.ListJoinTokens(ctx, connect.NewRequest(&controlv1.ListJoinTokensRequest{}))
			return err
		},
		"RevokeJoinToken": func(c controlv1connect.ControlServiceClient) error {
			_, err := c.RevokeJoinToken(ctx, connect.NewRequest(&controlv1.RevokeJoinTokenRequest{Id: "0123456789abcdef"}))
			return err
		},
		"AllowReenroll": func(c controlv1connect.ControlServiceClient) error {
			_, err := c.AllowReenroll(ctx, connect.NewRequest(&controlv1.AllowReenrollRequest{NodeId: "node-1"}))
			return err
		},
	}
	for name, call := range calls {
		requireCode(t, call(b.viewer), connect.CodePermissionDenied, name)
		requireCode(t, call(b.operator), connect.CodePermissionDenied, name)
		requireCode(t, call(b.anon), connect.CodeUnauthenticated, name)
	}
	require.Zero(t, b.count(`SELECT count(*) FROM join_tokens`))
	require.Zero(t, b.count(`SELECT count(*) FROM audit_events`))
}

func TestCreateJoinTokenValidation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	_, err := b.admin.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: "gpu"}))
	require.NoError(t, err)
	before := b.rowCounts()
	for _, c := range []struct {
		field string
		req   *controlv1.CreateJoinTokenRequest
	}{
		{"ttl", &controlv1.CreateJoinTokenRequest{Ttl: durationpb.New(59 * time.Second)}},
		{"ttl", &controlv1.CreateJoinTokenRequest{Ttl: durationpb.New(30*24*time.Hour + time.Second)}},
		{"max_uses", &controlv1.CreateJoinTokenRequest{MaxUses: -1}},
		{"max_uses", &controlv1.CreateJoinTokenRequest{MaxUses: 100001}},
		{"labels", &controlv1.CreateJoinTokenRequest{Labels: map[string]string{"-bad": "x"}}},
		{"pool_id", &controlv1.CreateJoinTokenRequest{PoolId: "bad pool"}},
		{"description", &controlv1.CreateJoinTokenRequest{Description: strings.Repeat("é", 101)}},
		{"description", &controlv1.CreateJoinTokenRequest{Description: "a\x1bb"}},
	} {
		_, err := b.admin.CreateJoinToken(ctx, connect.NewRequest(c.req))
		ce := requireConnectError(t, err, connect.CodeInvalidArgument, c.field)
		require.True(t, strings.HasPrefix(ce.Message(), c.field+":"), ce.Message())
	}
	_, err = b.admin.CreateJoinToken(ctx, connect.NewRequest(&controlv1.CreateJoinTokenRequest{PoolId: "nope"}))
	ce := requireConnectError(t, err, connect.CodeNotFound)
	require.Contains(t, ce.Message(), "pool_id")
	require.Equal(t, before, b.rowCounts())
	require.Zero(t, b.count(`SELECT count(*) FROM join_tokens`))

	// The bounds themselves are accepted.
	_, jt := b.joinToken(&controlv1.CreateJoinTokenRequest{Ttl: durationpb.New(time.Minute), MaxUses: 100000,
		Description: strings.Repeat("d", 200), PoolId: "gpu"})
	require.Equal(t, time.Minute, jt.GetExpiresAt().AsTime().Sub(jt.GetCreatedAt().AsTime()).Round(time.Second))
	require.EqualValues(t, 100000, jt.GetMaxUses())
	require.Equal(t, 1, b.count(`SELECT count(*) FROM audit_events WHERE method = 'CreateJoinToken' AND target_id = $1`, jt.GetId()))

	// ListJoinTokens: only usable ones, unless include_inactive.
	_, used := b.joinToken(&controlv1.CreateJoinTokenRequest{})
	b.exec(`UPDATE join_tokens SET uses = 1 WHERE id = $1`, used.GetId())
	ls, err := b.admin.ListJoinTokens(ctx, connect.NewRequest(&controlv1.ListJoinTokensRequest{}))
	require.NoError(t, err)
	require.Len(t, ls.Msg.GetJoinTokens(), 1)
	require.Equal(t, jt.GetId(), ls.Msg.GetJoinTokens()[0].GetId())
	all, err := b.admin.ListJoinTokens(ctx, connect.NewRequest(&controlv1.ListJoinTokensRequest{IncludeInactive: true}))
	require.NoError(t, err)
	require.Len(t, all.Msg.GetJoinTokens(), 2)
	require.Equal(t, used.GetId(), all.Msg.GetJoinTokens()[0].GetId(), "newest first")
}

// TestEnrollServiceNeedsNoBearer: EnrollmentService answers without a
// bearer token (a bad join token is UNAUTHENTICATED from the handler, not
// for a missing bearer), while ControlService still needs one; the body cap
// holds for the anonymous callers.
func TestEnrollServiceNeedsNoBearer(t *testing.T) {
	t.Parallel()
	b := setup(t)
	status, body := b.postJSON(enrollv1connect.EnrollmentServiceJoinProcedure, "", `{"token": "lhj_nope", "nodeId": "node-1"}`)
	require.Equal(t, http.StatusUnauthorized, status)
	require.Equal(t, "unauthenticated", body["code"])
	require.Contains(t, body["message"], "join token unknown")

	// A bearer token is not what authenticates a join: an admin's changes nothing.
	status, body = b.postJSON(enrollv1connect.EnrollmentServiceJoinProcedure, adminToken, `{"token": "lhj_nope", "nodeId": "node-1"}`)
	require.Equal(t, http.StatusUnauthorized, status)
	require.Contains(t, body["message"], "join token unknown")

	status, body = b.postJSON(controlv1connect.ControlServiceListJoinTokensProcedure, "", `{}`)
	require.Equal(t, http.StatusUnauthorized, status)
	require.Contains(t, body["message"], "missing bearer token")

	// Reachable by curl, as leasehold-node's client reaches it.
	token, _ := b.joinToken(&controlv1.CreateJoinTokenRequest{})
	status, body = b.postJSON(enrollv1connect.EnrollmentServiceJoinProcedure, "", `{"token": "`+token+`", "nodeId": "node-1"}`)
	require.Equal(t, http.StatusOK, status, body)
	require.Equal(t, "node-1", body["nodeId"])
	b.secret(body["credential"].(string))

	// An oversized anonymous body is refused before it is read in full.
	big, err := json.Marshal(map[string]any{"token": strings.Repeat("x", 200<<10), "nodeId": "node-2"})
	require.NoError(t, err)
	req, err := http.NewRequest(http.MethodPost, b.base+enrollv1connect.EnrollmentServiceJoinProcedure, bytes.NewReader(big))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	resp, err := b.http.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.NotEqual(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, 1, b.count(`SELECT count(*) FROM nodes`))
}

// TestJoinTokenCommand runs `leasehold-api join-token` against the test's
// database: create's first line is a token Join accepts, ls lists it,
// revoke ends it, and bad flags exit 2 naming the flag.
func TestJoinTokenCommand(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	_, err := b.admin.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: "gpu"}))
	require.NoError(t, err)
	db := []string{"--database-url", b.db.URL}
	if pgtest.Pooled() {
		db = append(db, "--pooler")
	}
	run := func(args ...string) (int, string, string) {
		var out, errOut bytes.Buffer
		code := JoinTokenCommand(ctx, append(args, db...), &out, &errOut)
		return code, out.String(), errOut.String()
	}

	code, out, errOut := run("create", "--uses", "2", "--label", "zone=a", "--label", "rack=r1", "--pool", "gpu", "--ttl", "2h",
		"--description", "batch 3")
	require.Equal(t, 0, code, errOut)
	token := strings.SplitN(out, "\n", 2)[0]
	b.secret(token)
	require.Regexp(t, `^lhj_[0-9a-f]{16}\.[A-Za-z0-9_-]{43}$`, token)
	id := strings.TrimPrefix(strings.SplitN(token, ".", 2)[0], "lhj_")
	require.Contains(t, out, "id "+id+": 2 use(s) until ")
	require.Contains(t, out, "pool gpu")
	require.Equal(t, 1, b.count(`SELECT count(*) FROM audit_events WHERE method = 'CreateJoinToken' AND actor LIKE 'cli:%' AND role = 'admin'`))

	_, err = b.join(token, "node-1", nil)
	require.NoError(t, err)
	got, err := b.viewer.GetNode(ctx, connect.NewRequest(&controlv1.GetNodeRequest{NodeId: "node-1"}))
	require.NoError(t, err)
	require.Equal(t, map[string]string{"zone": "a", "rack": "r1"}, got.Msg.GetNode().GetLabels())
	require.Equal(t, "gpu", got.Msg.GetNode().GetPoolId())

	code, out, errOut = run("ls")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, id)
	require.Contains(t, out, "1/2")
	require.NotContains(t, out, token)

	code, out, errOut = run("revoke", id)
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "join token "+id+" revoked")
	_, err = b.join(token, "node-2", nil)
	ce := requireConnectError(t, err, connect.CodeUnauthenticated)
	require.Contains(t, ce.Message(), "join token revoked")
	code, out, _ = run("ls")
	require.Equal(t, 0, code)
	require.NotContains(t, out, id)
	code, out, _ = run("ls", "--all")
	require.Equal(t, 0, code)
	require.Contains(t, out, "revoked")

	tokens := b.count(`SELECT count(*) FROM join_tokens`)
	for _, c := range []struct {
		flag string
		args []string
	}{
		{"--ttl", []string{"create", "--ttl", "10s"}},
		{"ttl", []string{"create", "--ttl", "soon"}},
		{"--uses", []string{"create", "--uses", "0"}},
		{"--uses", []string{"create", "--uses", "100001"}},
		{"label", []string{"create", "--label", "novalue"}},
		{"--label", []string{"create", "--label", "bad key=x"}},
		{"--pool", []string{"create", "--pool", "nope"}},
		{"--pool", []string{"create", "--pool", "bad pool"}},
		{"--description", []string{"create", "--description", strings.Repeat("d", 201)}},
		{"--all", []string{"create", "--all"}},
		{"<id>", []string{"revoke", "nope"}},
		{"id", []string{"revoke"}},
		{"subcommand", []string{"delete"}},
	} {
		code, _, errOut := run(c.args...)
		require.Equal(t, 2, code, "%v: %s", c.args, errOut)
		require.Contains(t, errOut, c.flag, "%v", c.args)
	}
	require.Equal(t, tokens, b.count(`SELECT count(*) FROM join_tokens`), "a refused command writes nothing")

	if os.Getenv("LEASEHOLD_DATABASE_URL") == "" {
		var out2, errOut2 bytes.Buffer
		require.Equal(t, 2, JoinTokenCommand(ctx, []string{"ls"}, &out2, &errOut2))
		require.Contains(t, errOut2.String(), "--database-url")
	}
}
