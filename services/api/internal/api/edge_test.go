package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"connectrpc.com/grpchealth"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/leasehold/leasehold/pkg/apiauth"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

func controlMethods() []string {
	methods := controlv1.File_leasehold_control_v1_control_proto.Services().ByName("ControlService").Methods()
	out := make([]string, methods.Len())
	for i := range methods.Len() {
		out[i] = string(methods.Get(i).Name())
	}
	return out
}

func procedure(method string) string { return "/" + controlv1connect.ControlServiceName + "/" + method }

func TestRoleMatrixCoversEveryMethod(t *testing.T) {
	t.Parallel()
	for _, m := range controlMethods() {
		_, ok := requiredRoles[procedure(m)]
		require.True(t, ok, "%s has no role in requiredRoles", m)
	}
	require.Len(t, requiredRoles, len(controlMethods()))
	require.Equal(t, apiauth.RoleAdmin, RequiredRole("/leasehold.control.v1.ControlService/Unknown"))
}

// TestInvalidArgumentsWriteNothing sends malformed requests to every method:
// each is INVALID_ARGUMENT, names its field first, and changes no row.
func TestInvalidArgumentsWriteNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	b.registerNode("node-1", nil)
	const secret = "a-secret-that-is-long-enough-but-has\x00nul"
	b.secret(secret)
	before := b.rowCounts()

	long := func(n int) string { return strings.Repeat("x", n) }
	manyLabels := map[string]string{}
	for i := range maxLabels + 1 {
		manyLabels[fmt.Sprintf("k%d", i)] = "v"
	}
	nodeToken := func() string {
		r, err := b.viewer.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{PageSize: 1}))
		require.NoError(t, err)
		return encodePage(pageKey{Method: "ListNodes", ID: r.Msg.GetNodes()[0].GetId()})
	}()
	node := nodev1.NodeKind_NODE_KIND_NODE
	a, o, v := b.admin, b.operator, b.viewer
	type call func() error
	cases := []struct {
		name, field string
		call        call
	}{
		// RegisterNode
		{"register empty id", "node_id", func() error {
			_, err := a.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{Kind: node}))
			return err
		}},
		{"register bad id", "node_id", func() error {
			_, err := a.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{NodeId: "bad id!", Kind: node}))
			return err
		}},
		{"register long id", "node_id", func() error {
			_, err := a.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{NodeId: long(201), Kind: node}))
			return err
		}},
		{"register no kind", "kind", func() error {
			_, err := a.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{NodeId: "n-x"}))
			return err
		}},
		{"register unknown kind", "kind", func() error {
			_, err := a.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{NodeId: "n-x", Kind: 77}))
			return err
		}},
		{"register agent without site", "site_id", func() error {
			_, err := a.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{NodeId: "n-x", Kind: nodev1.NodeKind_NODE_KIND_SITE_AGENT}))
			return err
		}},
		{"register bad site", "site_id", func() error {
			_, err := a.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{NodeId: "n-x", Kind: node, SiteId: "a b"}))
			return err
		}},
		{"register bad label key", "labels", func() error {
			_, err := a.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{NodeId: "n-x", Kind: node, Labels: map[string]string{"-k": "v"}}))
			return err
		}},
		{"register long label value", "labels[k]", func() error {
			_, err := a.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{NodeId: "n-x", Kind: node, Labels: map[string]string{"k": long(257)}}))
			return err
		}},
		{"register too many labels", "labels", func() error {
			_, err := a.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{NodeId: "n-x", Kind: node, Labels: manyLabels}))
			return err
		}},
		{"register bad pool", "pool_id", func() error {
			_, err := a.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{NodeId: "n-x", Kind: node, PoolId: "a/b"}))
			return err
		}},
		// RevokeNode, GetNode, ListNodes
		{"revoke empty", "node_id", func() error {
			_, err := a.RevokeNode(ctx, connect.NewRequest(&controlv1.RevokeNodeRequest{}))
			return err
		}},
		{"get node bad", "node_id", func() error {
			_, err := v.GetNode(ctx, connect.NewRequest(&controlv1.GetNodeRequest{NodeId: "x y"}))
			return err
		}},
		{"list nodes negative size", "page_size", func() error {
			_, err := v.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{PageSize: -1}))
			return err
		}},
		{"list nodes big size", "page_size", func() error {
			_, err := v.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{PageSize: 1001}))
			return err
		}},
		{"list nodes garbage token", "page_token", func() error {
			_, err := v.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{PageToken: "garbage!"}))
			return err
		}},
		{"list nodes huge token", "page_token", func() error {
			_, err := v.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{PageToken: long(5000)}))
			return err
		}},
		{"list nodes bad state", "state", func() error {
			_, err := v.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{State: 99}))
			return err
		}},
		{"list nodes bad pool", "pool_id", func() error {
			_, err := v.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{PoolId: "a b"}))
			return err
		}},
		// CreateCommand
		{"command no node", "node_id", func() error {
			_, err := o.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
			return err
		}},
		{"command no kind", "kind", func() error {
			_, err := o.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1"}))
			return err
		}},
		{"command bad kind", "kind", func() error {
			_, err := o.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "rm -rf"}))
			return err
		}},
		{"command big payload", "payload", func() error {
			_, err := o.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: make([]byte, maxPayloadBytes+1)}))
			return err
		}},
		{"command zero timeout", "timeout", func() error {
			_, err := o.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`), Expiry: &controlv1.CreateCommandRequest_Timeout{Timeout: durationpb.New(0)}}))
			return err
		}},
		{"command long timeout", "timeout", func() error {
			_, err := o.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`), Expiry: &controlv1.CreateCommandRequest_Timeout{Timeout: durationpb.New(8 * 24 * time.Hour)}}))
			return err
		}},
		{"command invalid timeout", "timeout", func() error {
			_, err := o.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`), Expiry: &controlv1.CreateCommandRequest_Timeout{Timeout: &durationpb.Duration{Seconds: 5, Nanos: -1}}}))
			return err
		}},
		{"command past deadline", "deadline", func() error {
			_, err := o.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`), Expiry: &controlv1.CreateCommandRequest_Deadline{Deadline: timestamppb.New(time.Now().Add(-time.Hour))}}))
			return err
		}},
		{"command far deadline", "deadline", func() error {
			_, err := o.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`), Expiry: &controlv1.CreateCommandRequest_Deadline{Deadline: timestamppb.New(time.Now().Add(30 * 24 * time.Hour))}}))
			return err
		}},
		{"command invalid deadline", "deadline", func() error {
			_, err := o.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`), Expiry: &controlv1.CreateCommandRequest_Deadline{Deadline: &timestamppb.Timestamp{Seconds: 1 << 60}}}))
			return err
		}},
		{"command bad key", "idempotency_key", func() error {
			_, err := o.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", IdempotencyKey: "has space"}))
			return err
		}},
		{"command long key", "idempotency_key", func() error {
			_, err := o.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", IdempotencyKey: long(201)}))
			return err
		}},
		// GetCommand, ListCommands, CancelCommand, WaitCommand
		{"get command empty", "command_id", func() error {
			_, err := v.GetCommand(ctx, connect.NewRequest(&controlv1.GetCommandRequest{}))
			return err
		}},
		{"list commands size", "page_size", func() error {
			_, err := v.ListCommands(ctx, connect.NewRequest(&controlv1.ListCommandsRequest{PageSize: 5000}))
			return err
		}},
		{"list commands node", "node_id", func() error {
			_, err := v.ListCommands(ctx, connect.NewRequest(&controlv1.ListCommandsRequest{NodeId: "x y"}))
			return err
		}},
		{"list commands state", "state", func() error {
			_, err := v.ListCommands(ctx, connect.NewRequest(&controlv1.ListCommandsRequest{State: 42}))
			return err
		}},
		{"list commands foreign token", "page_token", func() error {
			_, err := v.ListCommands(ctx, connect.NewRequest(&controlv1.ListCommandsRequest{PageToken: nodeToken}))
			return err
		}},
		{"cancel bad", "command_id", func() error {
			_, err := o.CancelCommand(ctx, connect.NewRequest(&controlv1.CancelCommandRequest{CommandId: "a b"}))
			return err
		}},
		{"wait empty", "command_id", func() error {
			_, err := v.WaitCommand(ctx, connect.NewRequest(&controlv1.WaitCommandRequest{}))
			return err
		}},
		{"wait too long", "timeout", func() error {
			_, err := v.WaitCommand(ctx, connect.NewRequest(&controlv1.WaitCommandRequest{CommandId: "c", Timeout: durationpb.New(61 * time.Second)}))
			return err
		}},
		{"wait negative", "timeout", func() error {
			_, err := v.WaitCommand(ctx, connect.NewRequest(&controlv1.WaitCommandRequest{CommandId: "c", Timeout: durationpb.New(-time.Second)}))
			return err
		}},
		// Pools
		{"pool empty id", "pool_id", func() error {
			_, err := a.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{}))
			return err
		}},
		{"pool long description", "description", func() error {
			_, err := a.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: "p", Description: long(1001)}))
			return err
		}},
		{"pool nul description", "description", func() error {
			_, err := a.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: "p", Description: "a\x00b"}))
			return err
		}},
		{"pool bad labels", "labels", func() error {
			_, err := a.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: "p", Labels: map[string]string{"": "v"}}))
			return err
		}},
		{"get pool empty", "pool_id", func() error {
			_, err := v.GetPool(ctx, connect.NewRequest(&controlv1.GetPoolRequest{}))
			return err
		}},
		{"list pools size", "page_size", func() error {
			_, err := v.ListPools(ctx, connect.NewRequest(&controlv1.ListPoolsRequest{PageSize: -5}))
			return err
		}},
		{"list pools token", "page_token", func() error {
			_, err := v.ListPools(ctx, connect.NewRequest(&controlv1.ListPoolsRequest{PageToken: "%%%"}))
			return err
		}},
		// Pool leases
		{"lease no pool", "pool_id", func() error {
			_, err := o.CreatePoolLease(ctx, connect.NewRequest(&controlv1.CreatePoolLeaseRequest{Tenant: "t", Count: 1}))
			return err
		}},
		{"lease no tenant", "tenant", func() error {
			_, err := o.CreatePoolLease(ctx, connect.NewRequest(&controlv1.CreatePoolLeaseRequest{PoolId: "p", Count: 1}))
			return err
		}},
		{"lease bad tenant", "tenant", func() error {
			_, err := o.CreatePoolLease(ctx, connect.NewRequest(&controlv1.CreatePoolLeaseRequest{PoolId: "p", Tenant: "a b", Count: 1}))
			return err
		}},
		{"lease zero count", "count", func() error {
			_, err := o.CreatePoolLease(ctx, connect.NewRequest(&controlv1.CreatePoolLeaseRequest{PoolId: "p", Tenant: "t"}))
			return err
		}},
		{"lease huge count", "count", func() error {
			_, err := o.CreatePoolLease(ctx, connect.NewRequest(&controlv1.CreatePoolLeaseRequest{PoolId: "p", Tenant: "t", Count: 10001}))
			return err
		}},
		{"lease bad selector key", "selector", func() error {
			_, err := o.CreatePoolLease(ctx, connect.NewRequest(&controlv1.CreatePoolLeaseRequest{PoolId: "p", Tenant: "t", Count: 1, Selector: map[string]string{"a b": "v"}}))
			return err
		}},
		{"lease bad selector value", "selector[zone]", func() error {
			_, err := o.CreatePoolLease(ctx, connect.NewRequest(&controlv1.CreatePoolLeaseRequest{PoolId: "p", Tenant: "t", Count: 1, Selector: map[string]string{"zone": "a\nb"}}))
			return err
		}},
		{"get lease empty", "pool_lease_id", func() error {
			_, err := v.GetPoolLease(ctx, connect.NewRequest(&controlv1.GetPoolLeaseRequest{}))
			return err
		}},
		{"list leases tenant", "tenant", func() error {
			_, err := v.ListPoolLeases(ctx, connect.NewRequest(&controlv1.ListPoolLeasesRequest{Tenant: "a b"}))
			return err
		}},
		{"list leases state", "state", func() error {
			_, err := v.ListPoolLeases(ctx, connect.NewRequest(&controlv1.ListPoolLeasesRequest{State: 9}))
			return err
		}},
		{"list leases pool", "pool_id", func() error {
			_, err := v.ListPoolLeases(ctx, connect.NewRequest(&controlv1.ListPoolLeasesRequest{PoolId: "!"}))
			return err
		}},
		{"release bad", "pool_lease_id", func() error {
			_, err := o.ReleasePoolLease(ctx, connect.NewRequest(&controlv1.ReleasePoolLeaseRequest{PoolLeaseId: "a b"}))
			return err
		}},
		// Sinks
		{"sink empty id", "sink_id", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "https://h", Secret: long(16)}))
			return err
		}},
		{"sink colon id", "sink_id", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "a:b", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "https://h", Secret: long(16)}))
			return err
		}},
		{"sink no kind", "kind", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Url: "https://h", Secret: long(16)}))
			return err
		}},
		{"sink no url", "url", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Secret: long(16)}))
			return err
		}},
		{"sink ftp url", "url", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "ftp://h/x", Secret: long(16)}))
			return err
		}},
		{"sink hostless url", "url", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "http://", Secret: long(16)}))
			return err
		}},
		{"sink relative url", "url", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "/hook", Secret: long(16)}))
			return err
		}},
		{"sink url with credentials", "url", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "https://u:p@h/x", Secret: long(16)}))
			return err
		}},
		{"sink url with space", "url", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "https://h/a b", Secret: long(16)}))
			return err
		}},
		{"sink short secret", "secret", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "https://h", Secret: "short"}))
			return err
		}},
		{"sink long secret", "secret", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "https://h", Secret: long(501)}))
			return err
		}},
		{"sink secret with nul", "secret", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "https://h", Secret: secret}))
			return err
		}},
		{"sink metadata url", "url", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "http://169.254.169.254/latest/meta-data/", Secret: long(16)}))
			return err
		}},
		{"sink ipv6 metadata url", "url", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "http://[fd00:ec2::254]/", Secret: long(16)}))
			return err
		}},
		{"sink loopback url", "url", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "http://127.0.0.1:9104/metrics", Secret: long(16)}))
			return err
		}},
		{"sink localhost url", "url", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "http://localhost/", Secret: long(16)}))
			return err
		}},
		{"sink private url", "url", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "https://10.0.0.7/hook", Secret: long(16)}))
			return err
		}},
		{"sink link-local url", "url", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "http://[fe80::1]/", Secret: long(16)}))
			return err
		}},
		{"sink bad whsec secret", "secret", func() error {
			_, err := a.CreateSink(ctx, connect.NewRequest(&controlv1.CreateSinkRequest{SinkId: "s", Kind: controlv1.SinkKind_SINK_KIND_WEBHOOK, Url: "https://h", Secret: "whsec_not*base64!!!!"}))
			return err
		}},
		{"delete sink empty", "sink_id", func() error {
			_, err := a.DeleteSink(ctx, connect.NewRequest(&controlv1.DeleteSinkRequest{}))
			return err
		}},
		// Views (ListSinks and ListGateways take no fields)
		{"list leases prefix", "name_prefix", func() error {
			_, err := v.ListLeases(ctx, connect.NewRequest(&controlv1.ListLeasesRequest{NamePrefix: "bad prefix"}))
			return err
		}},
		{"list leases size", "page_size", func() error {
			_, err := v.ListLeases(ctx, connect.NewRequest(&controlv1.ListLeasesRequest{PageSize: 2000}))
			return err
		}},
		{"stream output offset", "offset", func() error {
			st, err := v.StreamCommandOutput(ctx, connect.NewRequest(&controlv1.StreamCommandOutputRequest{CommandId: "c", Offset: -1}))
			if err != nil {
				return err
			}
			for st.Receive() {
			}
			return st.Err()
		}},
		{"stream output command", "command_id", func() error {
			st, err := v.StreamCommandOutput(ctx, connect.NewRequest(&controlv1.StreamCommandOutputRequest{CommandId: "a b"}))
			if err != nil {
				return err
			}
			for st.Receive() {
			}
			return st.Err()
		}},
		{"tunnel bad node", "open.node_id", func() error {
			return openTunnelErr(ctx, b, &controlv1.OpenTunnelRequest{Open: &controlv1.TunnelOpen{NodeId: "a b",
				Target: &controlv1.TunnelTarget{Kind: &controlv1.TunnelTarget_Port{Port: 22}}}})
		}},
		{"tunnel port zero", "open.target.port", func() error {
			return openTunnelErr(ctx, b, &controlv1.OpenTunnelRequest{Open: &controlv1.TunnelOpen{NodeId: "node-1",
				Target: &controlv1.TunnelTarget{Kind: &controlv1.TunnelTarget_Port{Port: 0}}}})
		}},
		{"tunnel no target", "open.target", func() error {
			return openTunnelErr(ctx, b, &controlv1.OpenTunnelRequest{Open: &controlv1.TunnelOpen{NodeId: "node-1"}})
		}},
		{"tunnel no open", "open", func() error {
			return openTunnelErr(ctx, b, &controlv1.OpenTunnelRequest{Data: []byte("x")})
		}},
		{"list workers group", "group", func() error {
			_, err := v.ListWorkers(ctx, connect.NewRequest(&controlv1.ListWorkersRequest{Group: "a b"}))
			return err
		}},
		// Node lifecycle and the audit trail
		{"cordon empty", "node_id", func() error {
			_, err := a.CordonNode(ctx, connect.NewRequest(&controlv1.CordonNodeRequest{}))
			return err
		}},
		{"cordon long reason", "reason", func() error {
			_, err := a.CordonNode(ctx, connect.NewRequest(&controlv1.CordonNodeRequest{NodeId: "node-1", Reason: long(201)}))
			return err
		}},
		{"uncordon bad", "node_id", func() error {
			_, err := a.UncordonNode(ctx, connect.NewRequest(&controlv1.UncordonNodeRequest{NodeId: "a b"}))
			return err
		}},
		{"drain long timeout", "timeout", func() error {
			_, err := a.DrainNode(ctx, connect.NewRequest(&controlv1.DrainNodeRequest{NodeId: "node-1", Timeout: durationpb.New(2 * MaxWait)}))
			return err
		}},
		{"drain control reason", "reason", func() error {
			_, err := a.DrainNode(ctx, connect.NewRequest(&controlv1.DrainNodeRequest{NodeId: "node-1", Reason: "a\x00b"}))
			return err
		}},
		{"decommission negative timeout", "timeout", func() error {
			_, err := a.DecommissionNode(ctx, connect.NewRequest(&controlv1.DecommissionNodeRequest{NodeId: "node-1", Timeout: durationpb.New(-time.Second)}))
			return err
		}},
		{"decommission empty", "node_id", func() error {
			_, err := a.DecommissionNode(ctx, connect.NewRequest(&controlv1.DecommissionNodeRequest{}))
			return err
		}},
		{"audit target id alone", "target_id", func() error {
			_, err := a.ListAuditEvents(ctx, connect.NewRequest(&controlv1.ListAuditEventsRequest{TargetId: "node-1"}))
			return err
		}},
		{"audit bad kind", "target_kind", func() error {
			_, err := a.ListAuditEvents(ctx, connect.NewRequest(&controlv1.ListAuditEventsRequest{TargetKind: "Node!"}))
			return err
		}},
		{"audit bad method", "method", func() error {
			_, err := a.ListAuditEvents(ctx, connect.NewRequest(&controlv1.ListAuditEventsRequest{Method: "a b"}))
			return err
		}},
		{"audit until before since", "until", func() error {
			now := time.Now()
			_, err := a.ListAuditEvents(ctx, connect.NewRequest(&controlv1.ListAuditEventsRequest{
				Since: timestamppb.New(now), Until: timestamppb.New(now.Add(-time.Minute))}))
			return err
		}},
		{"audit page token", "page_token", func() error {
			_, err := a.ListAuditEvents(ctx, connect.NewRequest(&controlv1.ListAuditEventsRequest{PageToken: "bm90LWEtdG9rZW4"}))
			return err
		}},
		// Runs (runs_test.go has the full table)
		{"run no target", "target", func() error {
			_, err := o.CreateRun(ctx, connect.NewRequest(&controlv1.CreateRunRequest{Kind: "exec"}))
			return err
		}},
		{"get run id", "run_id", func() error {
			_, err := v.GetRun(ctx, connect.NewRequest(&controlv1.GetRunRequest{RunId: "a b"}))
			return err
		}},
		{"list runs state", "state", func() error {
			_, err := v.ListRuns(ctx, connect.NewRequest(&controlv1.ListRunsRequest{State: 99}))
			return err
		}},
		{"cancel run id", "run_id", func() error {
			_, err := o.CancelRun(ctx, connect.NewRequest(&controlv1.CancelRunRequest{}))
			return err
		}},
		{"wait run timeout", "timeout", func() error {
			_, err := v.WaitRun(ctx, connect.NewRequest(&controlv1.WaitRunRequest{RunId: "r", Timeout: durationpb.New(time.Hour)}))
			return err
		}},
		{"stream run nodes id", "run_id", func() error {
			st, err := v.StreamRunNodes(ctx, connect.NewRequest(&controlv1.StreamRunNodesRequest{RunId: "a b"}))
			if err != nil {
				return err
			}
			for st.Receive() {
			}
			return st.Err()
		}},
		// Join tokens and re-enrolment
		{"join token short ttl", "ttl", func() error {
			_, err := a.CreateJoinToken(ctx, connect.NewRequest(&controlv1.CreateJoinTokenRequest{Ttl: durationpb.New(time.Second)}))
			return err
		}},
		{"join token uses", "max_uses", func() error {
			_, err := a.CreateJoinToken(ctx, connect.NewRequest(&controlv1.CreateJoinTokenRequest{MaxUses: -1}))
			return err
		}},
		{"revoke join token id", "id", func() error {
			_, err := a.RevokeJoinToken(ctx, connect.NewRequest(&controlv1.RevokeJoinTokenRequest{Id: "a b"}))
			return err
		}},
		{"reenroll node id", "node_id", func() error {
			_, err := a.AllowReenroll(ctx, connect.NewRequest(&controlv1.AllowReenrollRequest{NodeId: "a b"}))
			return err
		}},
	}
	// ListJoinTokens has only a flag: nothing to refuse.
	covered := map[string]bool{"ListSinks": true, "ListGateways": true, "ListJoinTokens": true}
	for _, tc := range cases {
		err := tc.call()
		ce := requireConnectError(t, err, connect.CodeInvalidArgument, tc.name)
		require.True(t, strings.HasPrefix(ce.Message(), tc.field+":"), "%s: message %q should start with %q", tc.name, ce.Message(), tc.field+":")
		require.NotContains(t, ce.Message(), secret)
	}
	require.Equal(t, before, b.rowCounts(), "invalid requests wrote rows")
	// Every method with fields has at least one case above (by the method
	// the case's client calls, recorded from the metrics).
	for _, m := range controlMethods() {
		if covered[m] {
			continue
		}
		n := testutil.ToFloat64(b.svcMetric(procedure(m), "invalid_argument"))
		require.Positive(t, n, "no invalid-argument case for %s", m)
	}
}

// openTunnelErr sends first as OpenTunnel's first message and returns the
// error of the first response, as an admin over h2c (bidi streams need
// HTTP/2).
func openTunnelErr(ctx context.Context, b *bundle, first *controlv1.OpenTunnelRequest) error {
	p := new(http.Protocols)
	p.SetUnencryptedHTTP2(true)
	c := controlv1connect.NewControlServiceClient(&http.Client{Transport: &http.Transport{Protocols: p}}, b.base,
		connect.WithInterceptors(bearer(adminToken)))
	st := c.OpenTunnel(ctx)
	defer func() { _ = st.CloseResponse() }()
	if err := st.Send(first); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	_ = st.CloseRequest()
	_, err := st.Receive()
	return err
}

// TestAuthOnEveryMethod: no token or an unknown one is UNAUTHENTICATED on
// every method; a role below the method's is PERMISSION_DENIED.
func TestAuthOnEveryMethod(t *testing.T) {
	t.Parallel()
	b := setup(t)
	before := b.rowCounts()
	for _, m := range controlMethods() {
		proc := procedure(m)
		for _, tok := range []string{"", "not-a-configured-token-123", adminToken + "x"} {
			code, body := b.postJSON(proc, tok, `{}`)
			require.Equal(t, http.StatusUnauthorized, code, "%s with token %q", m, tok)
			require.Equal(t, "unauthenticated", body["code"], m)
		}
		need := RequiredRole(proc)
		for tok, role := range map[string]apiauth.Role{viewerToken: apiauth.RoleViewer, operatorToken: apiauth.RoleOperator} {
			if role.Allows(need) {
				continue
			}
			code, body := b.postJSON(proc, tok, `{}`)
			require.Equal(t, http.StatusForbidden, code, "%s as %s", m, role)
			require.Equal(t, "permission_denied", body["code"], m)
		}
	}
	require.Equal(t, before, b.rowCounts())

	// Through the generated client too, and over the gRPC protocol.
	ctx := ctxT(t)
	_, err := b.anon.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{}))
	requireCode(t, err, connect.CodeUnauthenticated)
	_, err = b.viewer.RegisterNode(ctx, connect.NewRequest(&controlv1.RegisterNodeRequest{NodeId: "n", Kind: nodev1.NodeKind_NODE_KIND_NODE}))
	requireCode(t, err, connect.CodePermissionDenied)
	_, err = b.operator.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: "p"}))
	requireCode(t, err, connect.CodePermissionDenied)
	_, err = b.viewer.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "n", Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
	requireCode(t, err, connect.CodePermissionDenied)
	_, err = b.client("wrong-token-0000000000", connect.WithGRPC()).ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{}))
	requireCode(t, err, connect.CodeUnauthenticated)
	_, err = b.operator.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{}))
	require.NoError(t, err, "a higher role may read")

	require.Positive(t, testutil.ToFloat64(b.svcMetric(controlv1connect.ControlServiceListNodesProcedure, "unauthenticated")))
	require.Positive(t, testutil.ToFloat64(b.svcMetric(controlv1connect.ControlServiceRegisterNodeProcedure, "permission_denied")))
}

// TestJSONPostLikeCurl is the curl of docs/api.md: plain JSON over HTTP/1.1.
func TestJSONPostLikeCurl(t *testing.T) {
	t.Parallel()
	b := setup(t)
	code, body := b.postJSON("/leasehold.control.v1.ControlService/RegisterNode", adminToken,
		`{"nodeId":"node-j","kind":"NODE_KIND_NODE","labels":{"zone":"b"}}`)
	require.Equal(t, http.StatusOK, code, body)
	cred, _ := body["credential"].(string)
	b.secret(cred)
	require.NotEmpty(t, cred)
	require.Equal(t, "node-j", body["node"].(map[string]any)["id"])

	code, body = b.postJSON("/leasehold.control.v1.ControlService/ListNodes", viewerToken, `{}`)
	require.Equal(t, http.StatusOK, code)
	require.Len(t, body["nodes"], 1)
	require.Equal(t, "NODE_STATE_REGISTERED", body["nodes"].([]any)[0].(map[string]any)["state"])

	// Snake-case field names work too, and a bad one is a clear error.
	code, body = b.postJSON("/leasehold.control.v1.ControlService/GetNode", viewerToken, `{"node_id":"node-j"}`)
	require.Equal(t, http.StatusOK, code, body)
	code, body = b.postJSON("/leasehold.control.v1.ControlService/GetNode", viewerToken, `{"node_id":"bad id"}`)
	require.Equal(t, http.StatusBadRequest, code)
	require.Equal(t, "invalid_argument", body["code"])
	require.Contains(t, body["message"], "node_id:")
	code, body = b.postJSON("/leasehold.control.v1.ControlService/GetNode", viewerToken, `{"nodeId":"ghost"}`)
	require.Equal(t, http.StatusNotFound, code)
	require.Equal(t, "not_found", body["code"])

	resp, err := b.http.Post(b.base+"/leasehold.control.v1.ControlService/ListNodes", "application/json", strings.NewReader(`{}`))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
	require.Equal(t, `Bearer realm="leasehold"`, resp.Header.Get("WWW-Authenticate"))
}

func TestOversizedMessageRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	big := make([]byte, 5<<20)
	_, err := b.operator.CreateCommand(ctxT(t), connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "n", Kind: "exec", Payload: big}))
	requireCode(t, err, connect.CodeResourceExhausted)
	require.Zero(t, b.count(`SELECT count(*) FROM commands`))
}

func TestGRPCHealthOverH2C(t *testing.T) {
	t.Parallel()
	b := setup(t)
	tr := &http.Transport{Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr}
	resp, err := grpchealth.NewClient(hc, b.base, connect.WithGRPC()).Check(ctxT(t), &grpchealth.CheckRequest{Service: controlv1connect.ControlServiceName})
	require.NoError(t, err)
	require.Equal(t, grpchealth.StatusServing, resp.Status)

	c := controlv1connect.NewControlServiceClient(hc, b.base, connect.WithGRPC(), connect.WithInterceptors(bearer(viewerToken)))
	_, err = c.ListGateways(ctxT(t), connect.NewRequest(&controlv1.ListGatewaysRequest{}))
	require.NoError(t, err)
}

func TestStopAnswersWaitersAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	b.registerNode("node-1", nil)
	r, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		w, err := b.viewer.WaitCommand(ctx, connect.NewRequest(&controlv1.WaitCommandRequest{CommandId: r.Msg.GetCommand().GetId(), Timeout: durationpb.New(MaxWait)}))
		if err == nil && w.Msg.GetCommand().GetState() != controlv1.CommandState_COMMAND_STATE_PENDING {
			err = fmt.Errorf("state %s", w.Msg.GetCommand().GetState())
		}
		done <- err
	}()
	require.Eventually(t, func() bool { return b.svc.waiter.len() == 1 }, 5*time.Second, 10*time.Millisecond)
	start := time.Now()
	b.svc.StopAsync()
	require.NoError(t, <-done)
	require.NoError(t, b.svc.AwaitTerminated(context.Background()))
	require.Less(t, time.Since(start), 3*time.Second)
}
