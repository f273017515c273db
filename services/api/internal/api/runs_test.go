package api

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
)

var execTrue = []byte(`{"argv":["true"]}`)

// runRowCounts is rowCounts with the runs tables.
func (b *bundle) runRowCounts() map[string]int {
	b.t.Helper()
	out := b.rowCounts()
	out["runs"] = b.count("SELECT count(*) FROM runs")
	out["run_nodes"] = b.count("SELECT count(*) FROM run_nodes")
	return out
}

func runReq(target *controlv1.RunTarget, edit func(*controlv1.CreateRunRequest)) *connect.Request[controlv1.CreateRunRequest] {
	m := &controlv1.CreateRunRequest{Target: target, Kind: "exec", Payload: execTrue}
	if edit != nil {
		edit(m)
	}
	return connect.NewRequest(m)
}

func TestRunValidationWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	b.registerNode("n1", map[string]string{"env": "prod"})
	before := b.runRowCounts()
	sel := &controlv1.RunTarget{Selector: "env=prod"}
	cases := []struct {
		name, field string
		req         *connect.Request[controlv1.CreateRunRequest]
	}{
		{"no target", "target", runReq(nil, nil)},
		{"empty target", "target", runReq(&controlv1.RunTarget{Selector: "  "}, nil)},
		{"bad node id", "target.node_ids[1]", runReq(&controlv1.RunTarget{NodeIds: []string{"n1", "bad id"}}, nil)},
		{"bad selector", "target.selector: at position 4", runReq(&controlv1.RunTarget{Selector: "env prod"}, nil)},
		{"bad pool id", "target.pool_id", runReq(&controlv1.RunTarget{PoolId: "bad pool"}, nil)},
		{"no kind", "kind", runReq(sel, func(m *controlv1.CreateRunRequest) { m.Kind = "" })},
		{"bad payload", "payload.argv", runReq(sel, func(m *controlv1.CreateRunRequest) { m.Payload = []byte(`{"argv":[]}`) })},
		{"big payload", "payload", runReq(sel, func(m *controlv1.CreateRunRequest) {
			m.Kind, m.Payload = "custom", make([]byte, maxPayloadBytes+1)
		})},
		{"short timeout", "command_timeout", runReq(sel, func(m *controlv1.CreateRunRequest) { m.CommandTimeout = durationpb.New(time.Millisecond) })},
		{"in-flight 0", "max_in_flight", runReq(sel, func(m *controlv1.CreateRunRequest) { m.MaxInFlight = "0" })},
		{"in-flight 0%", "max_in_flight", runReq(sel, func(m *controlv1.CreateRunRequest) { m.MaxInFlight = "0%" })},
		{"in-flight 101%", "max_in_flight", runReq(sel, func(m *controlv1.CreateRunRequest) { m.MaxInFlight = "101%" })},
		{"in-flight word", "max_in_flight", runReq(sel, func(m *controlv1.CreateRunRequest) { m.MaxInFlight = "ten" })},
		{"in-flight negative", "max_in_flight", runReq(sel, func(m *controlv1.CreateRunRequest) { m.MaxInFlight = "-1" })},
		{"in-flight %", "max_in_flight", runReq(sel, func(m *controlv1.CreateRunRequest) { m.MaxInFlight = "%" })},
		{"failures 150%", "max_failures", runReq(sel, func(m *controlv1.CreateRunRequest) { m.MaxFailures = "150%" })},
		{"failures 1.5", "max_failures", runReq(sel, func(m *controlv1.CreateRunRequest) { m.MaxFailures = "1.5" })},
		{"pause over 1h", "batch_pause", runReq(sel, func(m *controlv1.CreateRunRequest) { m.BatchPause = durationpb.New(61 * time.Minute) })},
		{"pause negative", "batch_pause", runReq(sel, func(m *controlv1.CreateRunRequest) { m.BatchPause = durationpb.New(-time.Second) })},
		{"long description", "description", runReq(sel, func(m *controlv1.CreateRunRequest) { m.Description = strings.Repeat("é", 101) })},
		{"control description", "description", runReq(sel, func(m *controlv1.CreateRunRequest) { m.Description = "a\x01b" })},
		{"bad key", "idempotency_key", runReq(sel, func(m *controlv1.CreateRunRequest) { m.IdempotencyKey = "has space" })},
	}
	for _, c := range cases {
		_, err := b.operator.CreateRun(ctx, c.req)
		ce := requireConnectError(t, err, connect.CodeInvalidArgument, c.name)
		require.True(t, strings.HasPrefix(ce.Message(), c.field), "%s: %q should start with %q", c.name, ce.Message(), c.field)
	}
	_, err := b.operator.CreateRun(ctx, runReq(&controlv1.RunTarget{PoolId: "nope"}, nil))
	ce := requireConnectError(t, err, connect.CodeNotFound)
	require.True(t, strings.HasPrefix(ce.Message(), "target.pool_id"), ce.Message())
	_, err = b.operator.CreateRun(ctx, runReq(&controlv1.RunTarget{NodeIds: []string{"n1", "ghost"}}, nil))
	ce = requireConnectError(t, err, connect.CodeNotFound)
	require.Contains(t, ce.Message(), `target.node_ids: node "ghost" not found`)
	// Zero matching nodes: FAILED_PRECONDITION, nothing written.
	_, err = b.operator.CreateRun(ctx, runReq(&controlv1.RunTarget{Selector: "env=dev"}, nil))
	ce = requireConnectError(t, err, connect.CodeFailedPrecondition)
	require.Equal(t, "target: matches no node", ce.Message())
	_, err = b.operator.CreateRun(ctx, runReq(&controlv1.RunTarget{NodeIds: []string{"n1"}, Selector: "env!=prod"}, nil))
	requireCode(t, err, connect.CodeFailedPrecondition, "the target's fields are ANDed")
	require.Equal(t, before, b.runRowCounts())
}

func TestRunCreateResolvesTarget(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	for i := range 10 {
		env := "prod"
		if i >= 8 {
			env = "dev"
		}
		b.registerNode(fmt.Sprintf("n%02d", i), map[string]string{"env": env, "rack": fmt.Sprint(i % 2)})
	}
	_, err := b.admin.CordonNode(ctx, connect.NewRequest(&controlv1.CordonNodeRequest{NodeId: "n01"}))
	require.NoError(t, err)
	_, err = b.admin.DrainNode(ctx, connect.NewRequest(&controlv1.DrainNodeRequest{NodeId: "n02"}))
	require.NoError(t, err)
	_, err = b.admin.RevokeNode(ctx, connect.NewRequest(&controlv1.RevokeNodeRequest{NodeId: "n03"}))
	require.NoError(t, err)

	resp, err := b.operator.CreateRun(ctx, runReq(&controlv1.RunTarget{Selector: "env in (prod), rack"}, func(m *controlv1.CreateRunRequest) {
		m.MaxInFlight, m.MaxFailures, m.Description = "30%", "30%", "rollout"
		m.CommandTimeout, m.BatchPause = durationpb.New(90*time.Second), durationpb.New(2*time.Second)
	}))
	require.NoError(t, err)
	run := resp.Msg.GetRun()
	require.True(t, resp.Msg.GetCreated())
	// n00..n07 are prod; n03 is revoked: 7 nodes, two of them skipped.
	require.EqualValues(t, 7, run.GetTotal())
	require.EqualValues(t, 3, run.GetMaxInFlight(), "ceil(30% of 7)")
	require.EqualValues(t, 2, run.GetMaxFailures(), "floor(30% of 7)")
	require.Equal(t, map[string]int32{"pending": 5, "skipped": 2}, run.GetCounts())
	require.Equal(t, controlv1.RunState_RUN_STATE_RUNNING, run.GetState())
	require.Equal(t, 90*time.Second, run.GetCommandTimeout().AsDuration())
	require.Equal(t, 2*time.Second, run.GetBatchPause().AsDuration())
	require.Equal(t, "env in (prod), rack", run.GetTarget().GetSelector(), "as given")
	require.Equal(t, "rollout", run.GetDescription())

	got, err := b.viewer.GetRun(ctx, connect.NewRequest(&controlv1.GetRunRequest{RunId: run.GetId()}))
	require.NoError(t, err)
	var ids []string
	for _, n := range got.Msg.GetNodes() {
		ids = append(ids, n.GetNodeId())
		if n.GetNodeId() == "n01" || n.GetNodeId() == "n02" {
			require.Equal(t, controlv1.RunNodeState_RUN_NODE_STATE_SKIPPED, n.GetState())
			require.Contains(t, n.GetError(), "cordoned")
		} else {
			require.Equal(t, controlv1.RunNodeState_RUN_NODE_STATE_PENDING, n.GetState())
		}
	}
	require.Equal(t, []string{"n00", "n01", "n02", "n04", "n05", "n06", "n07"}, ids)
	require.Equal(t, 1, b.count(`SELECT count(*) FROM work_queue WHERE reconciler = 'runs' AND key = $1`, run.GetId()))
	require.Equal(t, 1, b.count(`SELECT count(*) FROM audit_events WHERE method = 'CreateRun' AND target_id = $1 AND outcome = 'ok'`, run.GetId()))
	require.Equal(t, 0, b.count(`SELECT count(*) FROM commands`), "the api starts no command: the reconciler does")

	// Numbers are stored as given; a pool narrows the target.
	_, err = b.admin.CreatePool(ctx, connect.NewRequest(&controlv1.CreatePoolRequest{PoolId: "p"}))
	require.NoError(t, err)
	b.exec(`UPDATE nodes SET pool_id = 'p' WHERE id IN ('n00', 'n08')`)
	resp, err = b.operator.CreateRun(ctx, runReq(&controlv1.RunTarget{PoolId: "p"}, func(m *controlv1.CreateRunRequest) {
		m.MaxInFlight, m.MaxFailures = "7", "0"
	}))
	require.NoError(t, err)
	require.EqualValues(t, 2, resp.Msg.GetRun().GetTotal())
	require.EqualValues(t, 7, resp.Msg.GetRun().GetMaxInFlight())
	require.EqualValues(t, 0, resp.Msg.GetRun().GetMaxFailures())
	// Defaults: 50 in flight, no failure allowed; 1% of 2 nodes rounds up to 1.
	resp, err = b.operator.CreateRun(ctx, runReq(&controlv1.RunTarget{NodeIds: []string{"n00", "n08"}}, nil))
	require.NoError(t, err)
	require.EqualValues(t, 50, resp.Msg.GetRun().GetMaxInFlight())
	require.EqualValues(t, 0, resp.Msg.GetRun().GetMaxFailures())
	resp, err = b.operator.CreateRun(ctx, runReq(&controlv1.RunTarget{NodeIds: []string{"n00", "n08"}}, func(m *controlv1.CreateRunRequest) {
		m.MaxInFlight, m.MaxFailures = "1%", "99%"
	}))
	require.NoError(t, err)
	require.EqualValues(t, 1, resp.Msg.GetRun().GetMaxInFlight())
	require.EqualValues(t, 1, resp.Msg.GetRun().GetMaxFailures())

	list, err := b.viewer.ListRuns(ctx, connect.NewRequest(&controlv1.ListRunsRequest{PageSize: 2}))
	require.NoError(t, err)
	require.Len(t, list.Msg.GetRuns(), 2)
	require.NotEmpty(t, list.Msg.GetNextPageToken())
	rest, err := b.viewer.ListRuns(ctx, connect.NewRequest(&controlv1.ListRunsRequest{PageSize: 2, PageToken: list.Msg.GetNextPageToken()}))
	require.NoError(t, err)
	require.Len(t, rest.Msg.GetRuns(), 2)
	require.Empty(t, rest.Msg.GetNextPageToken())
	require.Equal(t, run.GetId(), rest.Msg.GetRuns()[1].GetId(), "newest first")
	none, err := b.viewer.ListRuns(ctx, connect.NewRequest(&controlv1.ListRunsRequest{State: controlv1.RunState_RUN_STATE_SUCCEEDED}))
	require.NoError(t, err)
	require.Empty(t, none.Msg.GetRuns())
}

func TestRunIdempotencyAndRoles(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	b.registerNode("n1", nil)
	target := &controlv1.RunTarget{NodeIds: []string{"n1"}}
	withKey := func(m *controlv1.CreateRunRequest) { m.IdempotencyKey = "deploy-7" }
	first, err := b.operator.CreateRun(ctx, runReq(target, withKey))
	require.NoError(t, err)
	require.True(t, first.Msg.GetCreated())
	again, err := b.operator.CreateRun(ctx, runReq(target, withKey))
	require.NoError(t, err)
	require.False(t, again.Msg.GetCreated())
	require.Equal(t, first.Msg.GetRun().GetId(), again.Msg.GetRun().GetId())
	require.Equal(t, "deploy-7", again.Msg.GetRun().GetIdempotencyKey())
	_, err = b.operator.CreateRun(ctx, runReq(target, func(m *controlv1.CreateRunRequest) {
		withKey(m)
		m.Payload = []byte(`{"argv":["false"]}`)
	}))
	requireCode(t, err, connect.CodeAlreadyExists)
	require.Equal(t, 1, b.count(`SELECT count(*) FROM runs`))
	require.Equal(t, 1, b.count(`SELECT count(*) FROM audit_events WHERE method = 'CreateRun' AND outcome = 'unchanged'`))

	_, err = b.viewer.CreateRun(ctx, runReq(target, nil))
	requireCode(t, err, connect.CodePermissionDenied)
	_, err = b.viewer.CancelRun(ctx, connect.NewRequest(&controlv1.CancelRunRequest{RunId: first.Msg.GetRun().GetId()}))
	requireCode(t, err, connect.CodePermissionDenied)
	_, err = b.viewer.GetRun(ctx, connect.NewRequest(&controlv1.GetRunRequest{RunId: first.Msg.GetRun().GetId()}))
	require.NoError(t, err)
	_, err = b.viewer.GetRun(ctx, connect.NewRequest(&controlv1.GetRunRequest{RunId: "nope"}))
	requireCode(t, err, connect.CodeNotFound)
	_, err = b.admin.CreateRun(ctx, runReq(target, nil))
	require.NoError(t, err, "a higher role may create")
}

func TestCancelRun(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	for _, id := range []string{"a", "b", "c"} {
		b.registerNode(id, nil)
	}
	resp, err := b.operator.CreateRun(ctx, runReq(&controlv1.RunTarget{NodeIds: []string{"a", "b", "c"}}, nil))
	require.NoError(t, err)
	runID := resp.Msg.GetRun().GetId()
	// Node a is running: its command was given to it (what the reconciler
	// and a gateway would have done).
	cmd, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "a", Kind: "exec", Payload: execTrue}))
	require.NoError(t, err)
	cmdID := cmd.Msg.GetCommand().GetId()
	b.exec(`UPDATE commands SET state = 'dispatched', dispatched_at = compute_now() WHERE id = $1`, cmdID)
	b.exec(`UPDATE run_nodes SET state = 'running', command_id = $2, started_at = compute_now() WHERE run_id = $1 AND node_id = 'a'`, runID, cmdID)

	// A waiter returns when the run ends.
	waited := make(chan *controlv1.Run, 1)
	go func() {
		w, err := b.viewer.WaitRun(ctx, connect.NewRequest(&controlv1.WaitRunRequest{RunId: runID, Timeout: durationpb.New(20 * time.Second)}))
		if err == nil {
			waited <- w.Msg.GetRun()
		}
		close(waited)
	}()
	short, err := b.viewer.WaitRun(ctx, connect.NewRequest(&controlv1.WaitRunRequest{RunId: runID, Timeout: durationpb.New(50 * time.Millisecond)}))
	require.NoError(t, err)
	require.Equal(t, controlv1.RunState_RUN_STATE_RUNNING, short.Msg.GetRun().GetState(), "a wait that times out returns the run as it stands")

	c, err := b.operator.CancelRun(ctx, connect.NewRequest(&controlv1.CancelRunRequest{RunId: runID, Reason: "bad build"}))
	require.NoError(t, err)
	run := c.Msg.GetRun()
	require.Equal(t, controlv1.RunState_RUN_STATE_CANCELLED, run.GetState())
	require.Equal(t, "bad build", run.GetReason())
	require.NotNil(t, run.GetFinishedAt())
	require.Equal(t, map[string]int32{"not_started": 2, "running": 1}, run.GetCounts())
	got, err := b.viewer.GetCommand(ctx, connect.NewRequest(&controlv1.GetCommandRequest{CommandId: cmdID}))
	require.NoError(t, err)
	require.Equal(t, controlv1.CommandState_COMMAND_STATE_CANCELLED, got.Msg.GetCommand().GetState())
	require.NotNil(t, got.Msg.GetCommand().GetCancelRequestedAt(), "its node is told to stop, as CancelCommand does")
	require.Equal(t, 1, b.count(`SELECT count(*) FROM audit_events WHERE method = 'CancelCommand' AND target_id = $1 AND detail->>'run_id' = $2`, cmdID, runID))
	require.Equal(t, 1, b.count(`SELECT count(*) FROM audit_events WHERE method = 'CancelRun' AND target_id = $1 AND outcome = 'ok'`, runID))
	w := <-waited
	require.NotNil(t, w)
	require.Equal(t, controlv1.RunState_RUN_STATE_CANCELLED, w.GetState())

	// Idempotent.
	c, err = b.operator.CancelRun(ctx, connect.NewRequest(&controlv1.CancelRunRequest{RunId: runID}))
	require.NoError(t, err)
	require.Equal(t, "bad build", c.Msg.GetRun().GetReason())
	require.Equal(t, 1, b.count(`SELECT count(*) FROM audit_events WHERE method = 'CancelRun' AND outcome = 'unchanged'`))
	_, err = b.operator.CancelRun(ctx, connect.NewRequest(&controlv1.CancelRunRequest{RunId: "ghost"}))
	requireCode(t, err, connect.CodeNotFound)
	_, err = b.operator.CancelRun(ctx, connect.NewRequest(&controlv1.CancelRunRequest{RunId: runID, Reason: "a\x00"}))
	requireCode(t, err, connect.CodeInvalidArgument)

	// StreamRunNodes sends every node once, then the change the reconciler
	// would make, and ends when no node is left running.
	stream, err := b.viewer.StreamRunNodes(ctx, connect.NewRequest(&controlv1.StreamRunNodesRequest{RunId: runID}))
	require.NoError(t, err)
	seen := map[string][]controlv1.RunNodeState{}
	for range 3 {
		require.True(t, stream.Receive(), "%v", stream.Err())
		n := stream.Msg().GetNode()
		seen[n.GetNodeId()] = append(seen[n.GetNodeId()], n.GetState())
	}
	b.exec(`UPDATE run_nodes SET state = 'cancelled', finished_at = compute_now() WHERE run_id = $1 AND node_id = 'a'`, runID)
	for stream.Receive() {
		n := stream.Msg().GetNode()
		seen[n.GetNodeId()] = append(seen[n.GetNodeId()], n.GetState())
	}
	require.NoError(t, stream.Err())
	require.Equal(t, map[string][]controlv1.RunNodeState{
		"a": {controlv1.RunNodeState_RUN_NODE_STATE_RUNNING, controlv1.RunNodeState_RUN_NODE_STATE_CANCELLED},
		"b": {controlv1.RunNodeState_RUN_NODE_STATE_NOT_STARTED},
		"c": {controlv1.RunNodeState_RUN_NODE_STATE_NOT_STARTED},
	}, seen)
}

// TestRunSelectorSeesEffectiveLabels: a selector matches the labels a node
// shows (reported, overlaid by assigned), evaluated in SQL.
func TestRunSelectorSeesEffectiveLabels(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	b.registerNode("a", map[string]string{"env": "prod"})
	b.registerNode("b", nil)
	b.registerNode("c", map[string]string{"env": "dev"})
	// What the nodes report on Hello: a says dev (its assigned prod wins),
	// b says prod and has a gpu.
	b.exec(`UPDATE nodes SET labels = '{"env": "dev"}' WHERE id = 'a'`)
	b.exec(`UPDATE nodes SET labels = '{"env": "prod", "gpu": "a100"}' WHERE id = 'b'`)
	ids := func(sel string) []string {
		t.Helper()
		r, err := b.operator.CreateRun(ctx, runReq(&controlv1.RunTarget{Selector: sel}, nil))
		if err != nil {
			requireCode(t, err, connect.CodeFailedPrecondition, sel)
			return nil
		}
		g, err := b.viewer.GetRun(ctx, connect.NewRequest(&controlv1.GetRunRequest{RunId: r.Msg.GetRun().GetId()}))
		require.NoError(t, err)
		var out []string
		for _, n := range g.Msg.GetNodes() {
			out = append(out, n.GetNodeId())
		}
		return out
	}
	require.Equal(t, []string{"a", "b"}, ids("env=prod"))
	require.Equal(t, []string{"b"}, ids("gpu"))
	require.Equal(t, []string{"a", "c"}, ids("!gpu"))
	require.Equal(t, []string{"c"}, ids("env notin (prod)"))
	require.Equal(t, []string{"a", "b", "c"}, ids("env in (prod, dev)"))
	require.Nil(t, ids("env=prod,gpu=h100"))
}
