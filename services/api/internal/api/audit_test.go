package api

import (
	"crypto/sha256"
	"encoding/hex"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// actorOf is the audit actor of token: apiauth.Identity.ID.
func actorOf(token string) string {
	h := sha256.Sum256([]byte(token))
	return "sha256:" + hex.EncodeToString(h[:6])
}

type auditRow struct {
	actor, role, method, kind, target, outcome string
}

// lastAudit returns the newest audit row and the total count.
func (b *bundle) lastAudit() (auditRow, int) {
	b.t.Helper()
	var r auditRow
	n := b.count(`SELECT count(*) FROM audit_events`)
	if n == 0 {
		return r, 0
	}
	require.NoError(b.t, b.db.Pool.QueryRow(ctxT(b.t), `
SELECT actor, role, method, target_kind, target_id, outcome FROM audit_events ORDER BY id DESC LIMIT 1`).
		Scan(&r.actor, &r.role, &r.method, &r.kind, &r.target, &r.outcome))
	return r, n
}

// TestAuditEveryMutatingCall: each mutating call leaves exactly one row,
// with the caller's actor and role, the method and the target; a call that
// changes nothing leaves "unchanged"; a refused call leaves none.
func TestAuditEveryMutatingCall(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	a, o := b.admin, b.operator
	admin, operator := actorOf(adminToken), actorOf(operatorToken)
	var cmdID, leaseID string

	steps := []struct {
		name string
		call func() error
		want auditRow
	}{
		{"register", func() error {
			r, err := a.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{NodeId: "n1", Kind: nodev1.NodeKind_NODE_KIND_NODE}))
			if err == nil {
				b.secret(r.Msg.GetCredential())
			}
			return err
		}, auditRow{admin, "admin", "RegisterNode", "node", "n1", "ok"}},
		{"create pool", func() error {
			_, err := a.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: "p1"}))
			return err
		}, auditRow{admin, "admin", "CreatePool", "pool", "p1", "ok"}},
		{"create command", func() error {
			r, err := o.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "n1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`), IdempotencyKey: "k1"}))
			if err == nil {
				cmdID = r.Msg.GetCommand().GetId()
			}
			return err
		}, auditRow{operator, "operator", "CreateCommand", "command", "", "ok"}},
		{"repeat command", func() error {
			_, err := o.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "n1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`), IdempotencyKey: "k1"}))
			return err
		}, auditRow{operator, "operator", "CreateCommand", "command", "", "unchanged"}},
		{"cancel command", func() error {
			_, err := o.CancelCommand(ctx, connect.NewRequest(&controlv1.CancelCommandRequest{CommandId: cmdID}))
			return err
		}, auditRow{operator, "operator", "CancelCommand", "command", "", "ok"}},
		{"cancel finished command", func() error {
			_, err := o.CancelCommand(ctx, connect.NewRequest(&controlv1.CancelCommandRequest{CommandId: cmdID}))
			return err
		}, auditRow{operator, "operator", "CancelCommand", "command", "", "unchanged"}},
		{"create pool lease", func() error {
			r, err := o.CreatePoolLease(ctx, connect.NewRequest(&controlv1.CreatePoolLeaseRequest{PoolId: "p1", Tenant: "t", Count: 1}))
			if err == nil {
				leaseID = r.Msg.GetPoolLease().GetId()
			}
			return err
		}, auditRow{operator, "operator", "CreatePoolLease", "pool_lease", "", "ok"}},
		{"release pool lease", func() error {
			_, err := o.ReleasePoolLease(ctx, connect.NewRequest(&controlv1.ReleasePoolLeaseRequest{PoolLeaseId: leaseID}))
			return err
		}, auditRow{operator, "operator", "ReleasePoolLease", "pool_lease", "", "ok"}},
		{"release again", func() error {
			_, err := o.ReleasePoolLease(ctx, connect.NewRequest(&controlv1.ReleasePoolLeaseRequest{PoolLeaseId: leaseID}))
			return err
		}, auditRow{operator, "operator", "ReleasePoolLease", "pool_lease", "", "unchanged"}},
		{"create sink", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s1", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK,
				Url: "https://hooks.example.com/x", Secret: "a-secret-long-enough-0123"}))
			return err
		}, auditRow{admin, "admin", "CreateSink", "sink", "s1", "ok"}},
		{"delete sink", func() error {
			_, err := a.DeleteSink(ctx, connect.NewRequest(&controlv1.DeleteSinkRequest{SinkId: "s1"}))
			return err
		}, auditRow{admin, "admin", "DeleteSink", "sink", "s1", "ok"}},
		{"cordon", func() error {
			_, err := a.CordonNode(ctx, connect.NewRequest(&controlv1.CordonNodeRequest{NodeId: "n1", Reason: "disk"}))
			return err
		}, auditRow{admin, "admin", "CordonNode", "node", "n1", "ok"}},
		{"cordon again", func() error {
			_, err := a.CordonNode(ctx, connect.NewRequest(&controlv1.CordonNodeRequest{NodeId: "n1"}))
			return err
		}, auditRow{admin, "admin", "CordonNode", "node", "n1", "unchanged"}},
		{"uncordon", func() error {
			_, err := a.UncordonNode(ctx, connect.NewRequest(&controlv1.UncordonNodeRequest{NodeId: "n1"}))
			return err
		}, auditRow{admin, "admin", "UncordonNode", "node", "n1", "ok"}},
		{"drain", func() error {
			_, err := a.DrainNode(ctx, connect.NewRequest(&controlv1.DrainNodeRequest{NodeId: "n1"}))
			return err
		}, auditRow{admin, "admin", "DrainNode", "node", "n1", "ok"}},
		{"revoke", func() error {
			_, err := a.RevokeNode(ctx, connect.NewRequest(&controlv1.RevokeNodeRequest{NodeId: "n1"}))
			return err
		}, auditRow{admin, "admin", "RevokeNode", "node", "n1", "ok"}},
		{"revoke again", func() error {
			_, err := a.RevokeNode(ctx, connect.NewRequest(&controlv1.RevokeNodeRequest{NodeId: "n1"}))
			return err
		}, auditRow{admin, "admin", "RevokeNode", "node", "n1", "unchanged"}},
	}
	for _, s := range steps {
		_, before := b.lastAudit()
		require.NoError(t, s.call(), s.name)
		got, after := b.lastAudit()
		require.Equal(t, before+1, after, "%s: exactly one audit row", s.name)
		want := s.want
		switch want.kind {
		case "command":
			want.target = cmdID
		case "pool_lease":
			want.target = leaseID
		}
		require.Equal(t, want, got, s.name)
	}

	// Refused calls write nothing: not found, already exists, wrong role.
	_, before := b.lastAudit()
	_, err := a.RevokeNode(ctx, connect.NewRequest(&controlv1.RevokeNodeRequest{NodeId: "ghost"}))
	requireCode(t, err, connect.CodeNotFound)
	_, err = a.CordonNode(ctx, connect.NewRequest(&controlv1.CordonNodeRequest{NodeId: "ghost"}))
	requireCode(t, err, connect.CodeNotFound)
	_, err = a.UncordonNode(ctx, connect.NewRequest(&controlv1.UncordonNodeRequest{NodeId: "ghost"}))
	requireCode(t, err, connect.CodeNotFound)
	_, err = a.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: "p1"}))
	requireCode(t, err, connect.CodeAlreadyExists)
	_, err = a.DeleteSink(ctx, connect.NewRequest(&controlv1.DeleteSinkRequest{SinkId: "s1"}))
	requireCode(t, err, connect.CodeNotFound)
	_, err = o.CordonNode(ctx, connect.NewRequest(&controlv1.CordonNodeRequest{NodeId: "n1"}))
	requireCode(t, err, connect.CodePermissionDenied)
	_, after := b.lastAudit()
	require.Equal(t, before, after, "refused calls wrote audit rows")
}

// TestAuditRollsBackWithItsChange: when the audit row cannot be written the
// change it records is rolled back too, and the other way round.
func TestAuditRollsBackWithItsChange(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	b.registerNode("n1", nil)
	// The audit insert of these methods fails: their changes must vanish.
	b.exec(`ALTER TABLE audit_events ADD CONSTRAINT test_refuse CHECK (method NOT IN ('CreatePool', 'CordonNode', 'DeleteSink'))`)
	before := b.rowCounts()
	_, err := b.admin.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: "p1"}))
	requireCode(t, err, connect.CodeInternal)
	_, err = b.admin.CordonNode(ctx, connect.NewRequest(&controlv1.CordonNodeRequest{NodeId: "n1"}))
	requireCode(t, err, connect.CodeInternal)
	require.Equal(t, before, b.rowCounts())
	require.Zero(t, b.count(`SELECT count(*) FROM nodes WHERE cordoned_at IS NOT NULL`))

	// A change refused inside its transaction leaves no audit row either.
	_, err = b.operator.CreatePoolLease(ctx, connect.NewRequest(&controlv1.CreatePoolLeaseRequest{PoolId: "ghost", Tenant: "t", Count: 1}))
	requireCode(t, err, connect.CodeNotFound)
	require.Equal(t, before, b.rowCounts())
}

// TestListAuditEvents: admin only, newest first, each filter, pages.
func TestListAuditEvents(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	start := time.Now().Add(-time.Minute)
	for _, id := range []string{"p1", "p2", "p3"} {
		_, err := b.admin.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: id}))
		require.NoError(t, err)
	}
	b.registerNode("n1", nil)
	var leases []string
	for range 3 {
		r, err := b.operator.CreatePoolLease(ctx, connect.NewRequest(&controlv1.CreatePoolLeaseRequest{PoolId: "p1", Tenant: "t", Count: 1}))
		require.NoError(t, err)
		leases = append(leases, r.Msg.GetPoolLease().GetId())
	}
	_, err := b.operator.ReleasePoolLease(ctx, connect.NewRequest(&controlv1.ReleasePoolLeaseRequest{PoolLeaseId: leases[1]}))
	require.NoError(t, err)

	list := func(req *controlv1.ListAuditEventsRequest) []*controlv1.AuditEvent {
		t.Helper()
		r, err := b.admin.ListAuditEvents(ctx, connect.NewRequest(req))
		require.NoError(t, err)
		return r.Msg.GetEvents()
	}
	all := list(&controlv1.ListAuditEventsRequest{})
	require.Len(t, all, 8)
	for i := 1; i < len(all); i++ {
		require.Greater(t, all[i-1].GetId(), all[i].GetId(), "newest first")
	}
	require.Equal(t, "ReleasePoolLease", all[0].GetMethod())
	require.Equal(t, "p1", all[0].GetDetail().GetFields()["pool_id"].GetStringValue())
	require.Equal(t, "CreatePool", all[7].GetMethod())
	require.Equal(t, "p1", all[7].GetTargetId())

	require.Len(t, list(&controlv1.ListAuditEventsRequest{Actor: actorOf(operatorToken)}), 4)
	require.Len(t, list(&controlv1.ListAuditEventsRequest{Actor: actorOf(adminToken)}), 4)
	require.Len(t, list(&controlv1.ListAuditEventsRequest{Method: "CreatePool"}), 3)
	byTarget := list(&controlv1.ListAuditEventsRequest{TargetKind: "pool_lease", TargetId: leases[1]})
	require.Len(t, byTarget, 2)
	require.Equal(t, []string{"ReleasePoolLease", "CreatePoolLease"}, []string{byTarget[0].GetMethod(), byTarget[1].GetMethod()})
	require.Len(t, list(&controlv1.ListAuditEventsRequest{TargetKind: "node"}), 1)
	require.Len(t, list(&controlv1.ListAuditEventsRequest{Since: timestamppb.New(start)}), 8)
	require.Empty(t, list(&controlv1.ListAuditEventsRequest{Until: timestamppb.New(start)}))
	require.Empty(t, list(&controlv1.ListAuditEventsRequest{Since: timestamppb.New(time.Now().Add(time.Hour))}))
	// until is exclusive: the time of the newest event excludes just it.
	require.Len(t, list(&controlv1.ListAuditEventsRequest{Since: all[7].GetAt(), Until: all[0].GetAt()}),
		b.count(`SELECT count(*) FROM audit_events WHERE at < (SELECT max(at) FROM audit_events)`))

	// Pages of 3 walk every event once, in order.
	var walked []int64
	token := ""
	for {
		r, err := b.admin.ListAuditEvents(ctx, connect.NewRequest(&controlv1.ListAuditEventsRequest{PageSize: 3, PageToken: token}))
		require.NoError(t, err)
		require.LessOrEqual(t, len(r.Msg.GetEvents()), 3)
		for _, e := range r.Msg.GetEvents() {
			walked = append(walked, e.GetId())
		}
		if token = r.Msg.GetNextPageToken(); token == "" {
			break
		}
	}
	require.Len(t, walked, len(all))
	for i, e := range all {
		require.Equal(t, e.GetId(), walked[i])
	}
	// A token of another list is refused.
	p, err := b.viewer.ListPools(ctx, connect.NewRequest(&controlv1.ListPoolsRequest{PageSize: 1}))
	require.NoError(t, err)
	_, err = b.admin.ListAuditEvents(ctx, connect.NewRequest(&controlv1.ListAuditEventsRequest{PageToken: p.Msg.GetNextPageToken()}))
	requireCode(t, err, connect.CodeInvalidArgument)

	// Only admins read the trail.
	_, err = b.operator.ListAuditEvents(ctx, connect.NewRequest(&controlv1.ListAuditEventsRequest{}))
	requireCode(t, err, connect.CodePermissionDenied)
}

// TestAuditedSinkURLKeepsNoCredentials: the audit row of a created sink
// names the receiver's scheme and host, never the userinfo, path or query
// that may carry its credentials (every viewer reads the audit trail).
func TestAuditedSinkURLKeepsNoCredentials(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const token = "tok-0123456789"
	_, err := b.admin.CreateSink(ctxT(t), connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "chat", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK,
		Url: "https://hooks.example.com/services/" + token + "?sig=" + token, Secret: "a-secret-long-enough-0123"}))
	require.NoError(t, err)
	var detail string
	require.NoError(t, b.db.Pool.QueryRow(ctxT(t), `SELECT detail::text FROM audit_events WHERE method = 'CreateSink'`).Scan(&detail))
	require.Contains(t, detail, "https://hooks.example.com/…")
	require.NotContains(t, detail, token)
}
