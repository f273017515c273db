package api

import (
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
)

func TestCordonAndUncordon(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	b.registerNode("n1", nil)
	b.registerNode("n2", nil)
	c, err := b.admin.CordonNode(ctx, connect.NewRequest(&controlv1.CordonNodeRequest{NodeId: "n1", Reason: "bad disk"}))
	require.NoError(t, err)
	require.True(t, c.Msg.GetNode().GetCordoned())
	require.NotNil(t, c.Msg.GetNode().GetCordonedAt())

	g, err := b.viewer.GetNode(ctx, connect.NewRequest(&controlv1.GetNodeRequest{NodeId: "n1"}))
	require.NoError(t, err)
	require.True(t, g.Msg.GetNode().GetCordoned())
	require.True(t, g.Msg.GetNode().GetCordonedAt().AsTime().Equal(c.Msg.GetNode().GetCordonedAt().AsTime()))
	// Cordoning again keeps the first time.
	c2, err := b.admin.CordonNode(ctx, connect.NewRequest(&controlv1.CordonNodeRequest{NodeId: "n1"}))
	require.NoError(t, err)
	require.True(t, c2.Msg.GetNode().GetCordonedAt().AsTime().Equal(c.Msg.GetNode().GetCordonedAt().AsTime()))

	l, err := b.viewer.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{CordonedOnly: true}))
	require.NoError(t, err)
	require.Len(t, l.Msg.GetNodes(), 1)
	require.Equal(t, "n1", l.Msg.GetNodes()[0].GetId())
	l, err = b.viewer.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{}))
	require.NoError(t, err)
	require.Len(t, l.Msg.GetNodes(), 2)
	require.False(t, l.Msg.GetNodes()[1].GetCordoned())

	u, err := b.admin.UncordonNode(ctx, connect.NewRequest(&controlv1.UncordonNodeRequest{NodeId: "n1"}))
	require.NoError(t, err)
	require.False(t, u.Msg.GetNode().GetCordoned())
	require.Nil(t, u.Msg.GetNode().GetCordonedAt())
	l, err = b.viewer.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{CordonedOnly: true}))
	require.NoError(t, err)
	require.Empty(t, l.Msg.GetNodes())

	// The reason is in the audit trail.
	ev, err := b.admin.ListAuditEvents(ctx, connect.NewRequest(&controlv1.ListAuditEventsRequest{Method: "CordonNode"}))
	require.NoError(t, err)
	require.Len(t, ev.Msg.GetEvents(), 2)
	require.Equal(t, "bad disk", ev.Msg.GetEvents()[1].GetDetail().GetFields()["reason"].GetStringValue())

	// Operators and viewers may not.
	_, err = b.operator.UncordonNode(ctx, connect.NewRequest(&controlv1.UncordonNodeRequest{NodeId: "n1"}))
	requireCode(t, err, connect.CodePermissionDenied)
	_, err = b.viewer.DrainNode(ctx, connect.NewRequest(&controlv1.DrainNodeRequest{NodeId: "n1"}))
	requireCode(t, err, connect.CodePermissionDenied)
}

// busyNode registers node id with a running command and an allocation to a
// pool lease, as a gateway and the placer would leave them, and returns
// their ids.
func (b *bundle) busyNode(id string) (cmd, lease string) {
	b.t.Helper()
	ctx := ctxT(b.t)
	_, err := b.admin.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: "pool-" + id}))
	require.NoError(b.t, err)
	b.registerNode(id, nil)
	c, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: id, Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
	require.NoError(b.t, err)
	cmd = c.Msg.GetCommand().GetId()
	b.exec(`UPDATE commands SET state = 'acknowledged', dispatched_at = compute_now(), acked_at = compute_now() WHERE id = $1`, cmd)
	l, err := b.operator.CreatePoolLease(ctx, connect.NewRequest(&controlv1.CreatePoolLeaseRequest{PoolId: "pool-" + id, Tenant: "t", Count: 1}))
	require.NoError(b.t, err)
	lease = l.Msg.GetPoolLease().GetId()
	b.exec(`INSERT INTO node_allocations (node_id, pool_lease_id, pool_id, placer_epoch, placed_by) VALUES ($1, $2, $3, 1, 's1')`, id, lease, "pool-"+id)
	b.exec(`UPDATE pool_leases SET state = 'allocated', allocated_at = compute_now() WHERE id = $1`, lease)
	return cmd, lease
}

func TestDrainWaitsForCommandsAndAllocations(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	cmd, lease := b.busyNode("n1")

	// Without a timeout the drain cordons and reports at once.
	d, err := b.admin.DrainNode(ctx, connect.NewRequest(&controlv1.DrainNodeRequest{NodeId: "n1"}))
	require.NoError(t, err)
	require.False(t, d.Msg.GetDrained())
	require.True(t, d.Msg.GetNode().GetCordoned())
	require.Equal(t, []string{cmd}, d.Msg.GetRunningCommandIds())
	require.Equal(t, []string{lease}, d.Msg.GetPoolLeaseIds())

	// A drain that waits returns once the command ends and the lease is
	// released.
	type result struct {
		resp *connect.Response[controlv1.DrainNodeResponse]
		err  error
	}
	done := make(chan result, 1)
	go func() {
		r, err := b.admin.DrainNode(ctx, connect.NewRequest(&controlv1.DrainNodeRequest{NodeId: "n1", Timeout: durationpb.New(MaxWait)}))
		done <- result{r, err}
	}()
	// The drain is waiting: it wrote its audit row and has not returned.
	require.Eventually(t, func() bool {
		return b.count(`SELECT count(*) FROM audit_events WHERE method = 'DrainNode'`) == 2
	}, 10*time.Second, 10*time.Millisecond)
	b.exec(`UPDATE commands SET state = 'succeeded', finished_at = compute_now() WHERE id = $1`, cmd)
	select {
	case r := <-done:
		t.Fatalf("drain returned while a pool lease held the node: %+v", r)
	default:
	}
	_, err = b.operator.ReleasePoolLease(ctx, connect.NewRequest(&controlv1.ReleasePoolLeaseRequest{PoolLeaseId: lease}))
	require.NoError(t, err)
	var r result
	select {
	case r = <-done:
	case <-ctx.Done():
		t.Fatal("drain did not return after the node's work ended")
	}
	require.NoError(t, r.err)
	require.True(t, r.resp.Msg.GetDrained())
	require.Empty(t, r.resp.Msg.GetRunningCommandIds())
	require.Empty(t, r.resp.Msg.GetPoolLeaseIds())

	// A drain whose timeout passes reports what is left, it does not fail.
	_, lease2 := b.busyNode("n2")
	d, err = b.admin.DrainNode(ctx, connect.NewRequest(&controlv1.DrainNodeRequest{NodeId: "n2", Timeout: durationpb.New(time.Second)}))
	require.NoError(t, err)
	require.False(t, d.Msg.GetDrained())
	require.Equal(t, []string{lease2}, d.Msg.GetPoolLeaseIds())

	_, err = b.admin.DrainNode(ctx, connect.NewRequest(&controlv1.DrainNodeRequest{NodeId: "ghost"}))
	requireCode(t, err, connect.CodeNotFound)
}

func TestDecommissionRevokesOnlyADrainedNode(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	cmd, lease := b.busyNode("n1")

	d, err := b.admin.DecommissionNode(ctx, connect.NewRequest(&controlv1.DecommissionNodeRequest{NodeId: "n1", Reason: "retired"}))
	require.NoError(t, err)
	require.False(t, d.Msg.GetDecommissioned())
	require.Equal(t, []string{cmd}, d.Msg.GetRunningCommandIds())
	require.Equal(t, []string{lease}, d.Msg.GetPoolLeaseIds())
	require.True(t, d.Msg.GetNode().GetCordoned())
	require.NotEqual(t, controlv1.NodeState_NODE_STATE_REVOKED, d.Msg.GetNode().GetState())
	require.Zero(t, b.count(`SELECT count(*) FROM node_credentials WHERE node_id = 'n1' AND revoked_at IS NOT NULL`))

	b.exec(`UPDATE commands SET state = 'failed', finished_at = compute_now() WHERE id = $1`, cmd)
	_, err = b.operator.ReleasePoolLease(ctx, connect.NewRequest(&controlv1.ReleasePoolLeaseRequest{PoolLeaseId: lease}))
	require.NoError(t, err)
	d, err = b.admin.DecommissionNode(ctx, connect.NewRequest(&controlv1.DecommissionNodeRequest{NodeId: "n1", Timeout: durationpb.New(5 * time.Second)}))
	require.NoError(t, err)
	require.True(t, d.Msg.GetDecommissioned())
	require.Equal(t, controlv1.NodeState_NODE_STATE_REVOKED, d.Msg.GetNode().GetState())
	require.True(t, d.Msg.GetNode().GetCordoned())
	require.Zero(t, b.count(`SELECT count(*) FROM node_credentials WHERE node_id = 'n1' AND revoked_at IS NULL`))

	// The trail: a cordon, a cordon that changed nothing, the revoke.
	ev, err := b.admin.ListAuditEvents(ctx, connect.NewRequest(&controlv1.ListAuditEventsRequest{Method: "DecommissionNode"}))
	require.NoError(t, err)
	var got [][2]string
	for _, e := range ev.Msg.GetEvents() {
		got = append(got, [2]string{e.GetOutcome(), e.GetDetail().GetFields()["step"].GetStringValue()})
	}
	require.Equal(t, [][2]string{{"ok", "revoke"}, {"unchanged", "cordon"}, {"ok", "cordon"}}, got)

	// A revoked node cannot take commands.
	_, err = b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "n1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
	requireCode(t, err, connect.CodeFailedPrecondition)
}
