package api

import (
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
)

func TestPoolsAndPoolLeases(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	p, err := b.admin.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: "gpu", Description: "GPU boxes", Labels: map[string]string{"tier": "gold"}}))
	require.NoError(t, err)
	require.Equal(t, "GPU boxes", p.Msg.GetPool().GetDescription())
	require.Equal(t, map[string]string{"tier": "gold"}, p.Msg.GetPool().GetLabels())
	_, err = b.admin.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: "gpu"}))
	requireCode(t, err, connect.CodeAlreadyExists)
	_, err = b.admin.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: "cpu"}))
	require.NoError(t, err)
	pools, err := b.viewer.ListPools(ctx, connect.NewRequest(&controlv1.ListPoolsRequest{PageSize: 1}))
	require.NoError(t, err)
	require.Equal(t, "cpu", pools.Msg.GetPools()[0].GetId())
	pools, err = b.viewer.ListPools(ctx, connect.NewRequest(&controlv1.ListPoolsRequest{PageSize: 1, PageToken: pools.Msg.GetNextPageToken()}))
	require.NoError(t, err)
	require.Equal(t, "gpu", pools.Msg.GetPools()[0].GetId())
	require.Empty(t, pools.Msg.GetNextPageToken())
	_, err = b.viewer.GetPool(ctx, connect.NewRequest(&controlv1.GetPoolRequest{PoolId: "ghost"}))
	requireCode(t, err, connect.CodeNotFound)

	// A pool lease is pending and its pool is queued for the placer in the
	// same transaction.
	l, err := b.operator.CreatePoolLease(ctx, connect.NewRequest(&controlv1.CreatePoolLeaseRequest{PoolId: "gpu", Tenant: "team-a", Count: 2, Selector: map[string]string{"zone": "a"}}))
	require.NoError(t, err)
	lease := l.Msg.GetPoolLease()
	require.Equal(t, controlv1.PoolLeaseState_POOL_LEASE_STATE_PENDING, lease.GetState())
	require.Equal(t, map[string]string{"zone": "a"}, lease.GetSelector())
	require.EqualValues(t, 2, lease.GetCount())
	require.Empty(t, lease.GetAllocatedNodeIds())
	var gen1 int64
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT generation FROM work_queue WHERE reconciler = $1 AND key = 'gpu'`, PlacerReconciler).Scan(&gen1))
	_, err = b.operator.CreatePoolLease(ctx, connect.NewRequest(&controlv1.CreatePoolLeaseRequest{PoolId: "ghost", Tenant: "team-a", Count: 1}))
	requireCode(t, err, connect.CodeNotFound)
	require.Zero(t, b.count(`SELECT count(*) FROM work_queue WHERE key = 'ghost'`))

	// The placer allocates (simulated), the lease shows its nodes.
	b.registerNode("node-1", nil)
	b.registerNode("node-2", nil)
	b.exec(`INSERT INTO node_allocations (node_id, pool_lease_id, pool_id, placer_epoch, placed_by) VALUES ('node-2', $1, 'gpu', 1, 's1'), ('node-1', $1, 'gpu', 1, 's1')`, lease.GetId())
	b.exec(`UPDATE pool_leases SET state = 'allocated', allocated_at = compute_now() WHERE id = $1`, lease.GetId())
	got, err := b.viewer.GetPoolLease(ctx, connect.NewRequest(&controlv1.GetPoolLeaseRequest{PoolLeaseId: lease.GetId()}))
	require.NoError(t, err)
	require.Equal(t, controlv1.PoolLeaseState_POOL_LEASE_STATE_ALLOCATED, got.Msg.GetPoolLease().GetState())
	require.Equal(t, []string{"node-1", "node-2"}, got.Msg.GetPoolLease().GetAllocatedNodeIds())

	// Release: released, nodes freed, pool queued again, all at once.
	rel, err := b.operator.ReleasePoolLease(ctx, connect.NewRequest(&controlv1.ReleasePoolLeaseRequest{PoolLeaseId: lease.GetId()}))
	require.NoError(t, err)
	require.Equal(t, controlv1.PoolLeaseState_POOL_LEASE_STATE_RELEASED, rel.Msg.GetPoolLease().GetState())
	require.NotNil(t, rel.Msg.GetPoolLease().GetReleasedAt())
	require.Empty(t, rel.Msg.GetPoolLease().GetAllocatedNodeIds())
	require.Zero(t, b.count(`SELECT count(*) FROM node_allocations`))
	var gen2 int64
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT generation FROM work_queue WHERE reconciler = $1 AND key = 'gpu'`, PlacerReconciler).Scan(&gen2))
	require.Greater(t, gen2, gen1)
	again, err := b.operator.ReleasePoolLease(ctx, connect.NewRequest(&controlv1.ReleasePoolLeaseRequest{PoolLeaseId: lease.GetId()}))
	require.NoError(t, err)
	require.Equal(t, rel.Msg.GetPoolLease().GetReleasedAt().AsTime(), again.Msg.GetPoolLease().GetReleasedAt().AsTime())
	_, err = b.operator.ReleasePoolLease(ctx, connect.NewRequest(&controlv1.ReleasePoolLeaseRequest{PoolLeaseId: "ghost"}))
	requireCode(t, err, connect.CodeNotFound)

	// Listing: newest first, paginated and filtered.
	for _, tenant := range []string{"team-b", "team-b", "team-c"} {
		_, err := b.operator.CreatePoolLease(ctx, connect.NewRequest(&controlv1.CreatePoolLeaseRequest{PoolId: "cpu", Tenant: tenant, Count: 1}))
		require.NoError(t, err)
	}
	var ids []string
	req := &controlv1.ListPoolLeasesRequest{PageSize: 3}
	for {
		resp, err := b.viewer.ListPoolLeases(ctx, connect.NewRequest(req))
		require.NoError(t, err)
		for _, l := range resp.Msg.GetPoolLeases() {
			ids = append(ids, l.GetId())
		}
		if req.PageToken = resp.Msg.GetNextPageToken(); req.PageToken == "" {
			break
		}
	}
	require.Len(t, ids, 4)
	require.Equal(t, lease.GetId(), ids[3], "oldest last")
	byTenant, err := b.viewer.ListPoolLeases(ctx, connect.NewRequest(&controlv1.ListPoolLeasesRequest{Tenant: "team-b"}))
	require.NoError(t, err)
	require.Len(t, byTenant.Msg.GetPoolLeases(), 2)
	released, err := b.viewer.ListPoolLeases(ctx, connect.NewRequest(&controlv1.ListPoolLeasesRequest{State: controlv1.PoolLeaseState_POOL_LEASE_STATE_RELEASED, PoolId: "gpu"}))
	require.NoError(t, err)
	require.Len(t, released.Msg.GetPoolLeases(), 1)
}

func TestSinksNeverReturnSecrets(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	const secret = "webhook-secret-9d8c7b6a5f4e"
	b.secret(secret)
	s, err := b.admin.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "audit", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "https://hooks.example.com/leasehold?x=1", Secret: secret}))
	require.NoError(t, err)
	require.True(t, s.Msg.GetSink().GetHasSecret())
	require.NotContains(t, s.Msg.String(), secret)
	require.Equal(t, controlv1.SinkKind_SINK_KIND_WEBHOOK, s.Msg.GetSink().GetKind())
	_, err = b.admin.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "audit", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "https://x.example.com", Secret: secret}))
	requireCode(t, err, connect.CodeAlreadyExists)

	// In JSON too (what curl sees).
	code, body := b.postJSON("/leasehold.control.v1.ControlService/ListSinks", viewerToken, `{}`)
	require.Equal(t, 200, code)
	require.Len(t, body["sinks"], 1)
	require.NotContains(t, body["sinks"].([]any)[0], "secret")
	require.Equal(t, true, body["sinks"].([]any)[0].(map[string]any)["hasSecret"])

	b.exec(`INSERT INTO sink_cursors (sink_id, cursor) VALUES ('audit', 42)`)
	_, err = b.admin.DeleteSink(ctx, connect.NewRequest(&controlv1.DeleteSinkRequest{SinkId: "audit"}))
	require.NoError(t, err)
	require.Zero(t, b.count(`SELECT count(*) FROM sinks`))
	require.Zero(t, b.count(`SELECT count(*) FROM sink_cursors`))
	_, err = b.admin.DeleteSink(ctx, connect.NewRequest(&controlv1.DeleteSinkRequest{SinkId: "audit"}))
	requireCode(t, err, connect.CodeNotFound)
	list, err := b.viewer.ListSinks(ctx, connect.NewRequest(&controlv1.ListSinksRequest{}))
	require.NoError(t, err)
	require.Empty(t, list.Msg.GetSinks())
}

func TestReadOnlyViews(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	b.exec(`INSERT INTO leases (name, owner, epoch, expires_at) VALUES
  ('gateway:gw-1', 'gw-1', 3, compute_now() + interval '20 seconds'),
  ('gateway:gw-2', NULL, 1, '-infinity'),
  ('shard:1', 'w-1', 7, compute_now() + interval '15 seconds'),
  ('shard:2', 'w-1', 2, compute_now() - interval '1 second'),
  ('singleton:sweeper', 'w-2', 1, compute_now() + interval '15 seconds')`)
	b.exec(`INSERT INTO workers (id, member_group, heartbeat_at, clock_skew_ms) VALUES
  ('w-1', 'controllers', compute_now(), 12), ('w-2', 'controllers', compute_now() - interval '5 minutes', -3),
  ('scheduler/s-1', 'scheduler', compute_now(), 0)`)
	b.registerNode("node-1", nil)
	b.registerNode("node-2", nil)
	b.registerNode("node-3", nil)
	b.exec(`INSERT INTO node_sessions (node_id, gateway_id, state, session_expires_at) VALUES
  ('node-1', 'gw-1', 'connected', compute_now() + interval '40 seconds'),
  ('node-2', 'gw-1', 'connected', compute_now() + interval '40 seconds'),
  ('node-3', 'gw-9', 'connected', compute_now() + interval '40 seconds')`)

	leases, err := b.viewer.ListLeases(ctx, connect.NewRequest(&controlv1.ListLeasesRequest{NamePrefix: "shard:"}))
	require.NoError(t, err)
	require.Len(t, leases.Msg.GetLeases(), 2)
	require.Equal(t, "shard:1", leases.Msg.GetLeases()[0].GetName())
	require.Equal(t, "w-1", leases.Msg.GetLeases()[0].GetOwner())
	require.EqualValues(t, 7, leases.Msg.GetLeases()[0].GetEpoch())
	require.False(t, leases.Msg.GetLeases()[0].GetExpired())
	require.True(t, leases.Msg.GetLeases()[1].GetExpired())
	var names []string
	req := &controlv1.ListLeasesRequest{PageSize: 2}
	for {
		resp, err := b.viewer.ListLeases(ctx, connect.NewRequest(req))
		require.NoError(t, err)
		for _, l := range resp.Msg.GetLeases() {
			names = append(names, l.GetName())
		}
		if req.PageToken = resp.Msg.GetNextPageToken(); req.PageToken == "" {
			break
		}
	}
	require.Equal(t, []string{"gateway:gw-1", "gateway:gw-2", "shard:1", "shard:2", "singleton:sweeper"}, names)

	workers, err := b.viewer.ListWorkers(ctx, connect.NewRequest(&controlv1.ListWorkersRequest{Group: "controllers"}))
	require.NoError(t, err)
	require.Len(t, workers.Msg.GetWorkers(), 2)
	require.True(t, workers.Msg.GetWorkers()[0].GetLive())
	require.EqualValues(t, 12_000_000, workers.Msg.GetWorkers()[0].GetClockSkew().AsDuration())
	require.False(t, workers.Msg.GetWorkers()[1].GetLive())
	all, err := b.viewer.ListWorkers(ctx, connect.NewRequest(&controlv1.ListWorkersRequest{}))
	require.NoError(t, err)
	require.Len(t, all.Msg.GetWorkers(), 3)

	gws, err := b.viewer.ListGateways(ctx, connect.NewRequest(&controlv1.ListGatewaysRequest{}))
	require.NoError(t, err)
	require.Len(t, gws.Msg.GetGateways(), 3)
	g1, g2, g9 := gws.Msg.GetGateways()[0], gws.Msg.GetGateways()[1], gws.Msg.GetGateways()[2]
	require.Equal(t, "gw-1", g1.GetId())
	require.True(t, g1.GetLive())
	require.EqualValues(t, 3, g1.GetLeaseEpoch())
	require.EqualValues(t, 2, g1.GetSessions())
	require.Equal(t, "gw-2", g2.GetId())
	require.False(t, g2.GetLive())
	require.Nil(t, g2.GetLeaseExpiresAt())
	require.Equal(t, "gw-9", g9.GetId())
	require.False(t, g9.GetLive(), "sessions without a lease")
	require.EqualValues(t, 1, g9.GetSessions())

	n, err := b.viewer.GetNode(ctx, connect.NewRequest(&controlv1.GetNodeRequest{NodeId: "node-1"}))
	require.NoError(t, err)
	require.Equal(t, "gw-1", n.Msg.GetNode().GetGatewayId())
	require.EqualValues(t, 1, n.Msg.GetNode().GetSessionEpoch())
	require.NotNil(t, n.Msg.GetNode().GetLastSeenAt())
}
