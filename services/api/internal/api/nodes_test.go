package api

import (
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/nodereg"
)

func TestRegisterNodeReturnsCredentialOnceStoredHashed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	_, err := b.admin.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: "gpu"}))
	require.NoError(t, err)

	resp, err := b.admin.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{
		NodeId: "node-1", Kind: nodev1.NodeKind_NODE_KIND_NODE, Labels: map[string]string{"zone": "a"}, PoolId: "gpu",
	}))
	require.NoError(t, err)
	cred := resp.Msg.GetCredential()
	b.secret(cred)
	require.True(t, len(cred) > 40 && cred[:4] == nodeauth.Prefix, "credential %q", cred)
	n := resp.Msg.GetNode()
	require.Equal(t, "node-1", n.GetId())
	require.Equal(t, nodev1.NodeKind_NODE_KIND_NODE, n.GetKind())
	require.Equal(t, controlv1.NodeState_NODE_STATE_REGISTERED, n.GetState())
	require.Equal(t, map[string]string{"zone": "a"}, n.GetLabels())
	require.Equal(t, "gpu", n.GetPoolId())
	require.NotNil(t, n.GetCreatedAt())
	require.Nil(t, n.GetRevokedAt())

	// Stored only as its SHA-256: no column anywhere holds it in clear.
	var hash []byte
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT credential_hash FROM node_credentials WHERE node_id = 'node-1'`).Scan(&hash))
	require.Equal(t, nodeauth.Hash(cred), hash)
	require.Zero(t, b.count(`SELECT count(*) FROM node_credentials c, nodes n WHERE c::text LIKE '%' || $1 || '%' OR n::text LIKE '%' || $1 || '%'`, cred))
	id, err := nodereg.Verify(ctx, b.db.Pool, "node-1", cred)
	require.NoError(t, err)
	require.Equal(t, "node-1", id.NodeID)

	// Returned once: reads never carry it, and registering again is refused.
	got, err := b.viewer.GetNode(ctx, connect.NewRequest(&controlv1.GetNodeRequest{NodeId: "node-1"}))
	require.NoError(t, err)
	require.NotContains(t, got.Msg.String(), cred)
	_, err = b.admin.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{NodeId: "node-1", Kind: nodev1.NodeKind_NODE_KIND_NODE}))
	requireCode(t, err, connect.CodeAlreadyExists)
	require.Equal(t, 1, b.count(`SELECT count(*) FROM node_credentials WHERE node_id = 'node-1'`))

	// A site agent needs its site; an unknown pool writes nothing.
	sa, err := b.admin.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{NodeId: "agent-1", Kind: nodev1.NodeKind_NODE_KIND_SITE_AGENT, SiteId: "site-a"}))
	require.NoError(t, err)
	b.secret(sa.Msg.GetCredential())
	require.Equal(t, "site-a", sa.Msg.GetNode().GetSiteId())
	_, err = b.admin.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{NodeId: "node-2", Kind: nodev1.NodeKind_NODE_KIND_NODE, PoolId: "nope"}))
	ce := requireConnectError(t, err, connect.CodeNotFound)
	require.Contains(t, ce.Message(), "pool_id")
	require.Zero(t, b.count(`SELECT count(*) FROM nodes WHERE id = 'node-2'`))

	_, err = b.viewer.GetNode(ctx, connect.NewRequest(&controlv1.GetNodeRequest{NodeId: "ghost"}))
	requireCode(t, err, connect.CodeNotFound)

	// Pool node counts follow registration.
	pool, err := b.viewer.GetPool(ctx, connect.NewRequest(&controlv1.GetPoolRequest{PoolId: "gpu"}))
	require.NoError(t, err)
	require.EqualValues(t, 1, pool.Msg.GetPool().GetNodeCount())
}

func TestRevokeNode(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	cred := b.registerNode("node-1", nil)
	// The node is connected through a gateway.
	b.exec(`INSERT INTO node_sessions (node_id, gateway_id, session_expires_at) VALUES ('node-1', 'gw-1', compute_now() + interval '40 seconds')`)
	b.exec(`UPDATE nodes SET state = 'connected', state_epoch = 1 WHERE id = 'node-1'`)

	resp, err := b.admin.RevokeNode(ctx, connect.NewRequest(&controlv1.RevokeNodeRequest{NodeId: "node-1"}))
	require.NoError(t, err)
	n := resp.Msg.GetNode()
	require.Equal(t, controlv1.NodeState_NODE_STATE_REVOKED, n.GetState())
	require.NotNil(t, n.GetRevokedAt())
	require.Empty(t, n.GetGatewayId(), "the session is closed")
	_, err = nodereg.Verify(ctx, b.db.Pool, "node-1", cred)
	require.ErrorIs(t, err, nodereg.ErrUnauthenticated)
	require.Equal(t, 1, b.count(`SELECT count(*) FROM node_sessions WHERE node_id = 'node-1' AND state = 'disconnected'`))

	// Twice is fine; an unknown node is NOT_FOUND.
	again, err := b.admin.RevokeNode(ctx, connect.NewRequest(&controlv1.RevokeNodeRequest{NodeId: "node-1"}))
	require.NoError(t, err)
	require.Equal(t, n.GetRevokedAt().AsTime(), again.Msg.GetNode().GetRevokedAt().AsTime())
	_, err = b.admin.RevokeNode(ctx, connect.NewRequest(&controlv1.RevokeNodeRequest{NodeId: "ghost"}))
	requireCode(t, err, connect.CodeNotFound)

	// A revoked node takes no commands.
	_, err = b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
	requireCode(t, err, connect.CodeFailedPrecondition)
}

func TestListNodesPaginatesAcrossPages(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	// 250 nodes straight in SQL (registration is tested above).
	b.exec(`INSERT INTO nodes (id) SELECT format('n-%s', lpad(i::text, 3, '0')) FROM generate_series(1, 250) i`)
	b.exec(`UPDATE nodes SET state = 'connected' WHERE id IN ('n-007', 'n-123')`)

	var ids []string
	token, pages := "", 0
	for {
		resp, err := b.viewer.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{PageToken: token}))
		require.NoError(t, err)
		pages++
		for _, n := range resp.Msg.GetNodes() {
			ids = append(ids, n.GetId())
		}
		if token = resp.Msg.GetNextPageToken(); token == "" {
			break
		}
		require.Len(t, resp.Msg.GetNodes(), defaultPageSize)
	}
	require.Equal(t, 3, pages)
	require.Len(t, ids, 250)
	require.IsIncreasing(t, ids)

	// Exact fit: the last full page has no token.
	resp, err := b.viewer.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{PageSize: 250}))
	require.NoError(t, err)
	require.Len(t, resp.Msg.GetNodes(), 250)
	require.Empty(t, resp.Msg.GetNextPageToken())

	conn, err := b.viewer.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{State: controlv1.NodeState_NODE_STATE_CONNECTED, PageSize: 1}))
	require.NoError(t, err)
	require.Equal(t, "n-007", conn.Msg.GetNodes()[0].GetId())
	conn, err = b.viewer.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{State: controlv1.NodeState_NODE_STATE_CONNECTED, PageSize: 1, PageToken: conn.Msg.GetNextPageToken()}))
	require.NoError(t, err)
	require.Equal(t, "n-123", conn.Msg.GetNodes()[0].GetId())
	require.Empty(t, conn.Msg.GetNextPageToken())
}
