package api

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

// TestCreateGroupJudgesEachCreate writes one group of creates in one
// transaction: each create is judged on its own (a node that does not
// exist, a revoked node, the node's queue cap counting the group's own
// commands, a deadline out of range) and gets its own answer; the others
// are written, each with its audit row, and the refused ones write nothing.
func TestCreateGroupJudgesEachCreate(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *Config, _ *http.Transport) { c.MaxQueuedPerNode = 2 })
	ctx := ctxT(t)
	b.registerNode("node-1", nil)
	b.registerNode("node-2", nil)
	b.registerNode("node-r", nil)
	b.exec(`UPDATE nodes SET state = 'revoked' WHERE id = 'node-r'`)
	h := b.svc.handler

	pending := func(node string, expiry func(*controlv1.CreateCommandRequest)) *pendingCreate {
		m := &controlv1.CreateCommandRequest{NodeId: node, Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}
		if expiry != nil {
			expiry(m)
		}
		c, err := validateCreateCommand(m, time.Hour, maxPayloadBytes)
		require.NoError(t, err)
		return &pendingCreate{ctx: ctx, m: m, payload: m.GetPayload(), c: c, actor: "operator", role: "operator", done: make(chan createAnswer, 1)}
	}
	tooSoon := func(m *controlv1.CreateCommandRequest) {
		m.Expiry = &controlv1.CreateCommandRequest_Deadline{Deadline: timestamppb.New(time.Now().Add(time.Millisecond))}
	}
	group := []*pendingCreate{
		pending("node-1", nil),
		pending("node-missing", nil),
		pending("node-r", nil),
		pending("node-1", nil),
		pending("node-1", nil), // the third for node-1: past the cap of 2
		pending("node-2", tooSoon),
		pending("node-2", nil),
	}
	answers := make([]createAnswer, len(group))
	require.NoError(t, pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error { return h.createGroupTx(ctx, tx, group, answers) }))

	for _, i := range []int{0, 3, 6} {
		require.NoError(t, answers[i].err, "create %d", i)
		cmd := answers[i].cmd
		require.NotNil(t, cmd, "create %d", i)
		require.Equal(t, group[i].m.GetNodeId(), cmd.GetNodeId())
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_PENDING, cmd.GetState())
		require.Equal(t, 1, b.count(`SELECT count(*) FROM commands WHERE id = $1 AND node_id = $2 AND kind = 'exec'`, cmd.GetId(), cmd.GetNodeId()))
		require.Equal(t, 1, b.count(`SELECT count(*) FROM audit_events WHERE method = 'CreateCommand' AND target_id = $1 AND actor = 'operator'
		   AND detail->>'node_id' = $2`, cmd.GetId(), cmd.GetNodeId()), "create %d is audited", i)
	}
	require.NotEqual(t, answers[0].cmd.GetId(), answers[3].cmd.GetId())
	requireCode(t, answers[1].err, connect.CodeNotFound)
	require.Contains(t, answers[1].err.Error(), `node_id: node "node-missing" not found`)
	requireCode(t, answers[2].err, connect.CodeFailedPrecondition)
	require.Contains(t, answers[2].err.Error(), "revoked")
	requireCode(t, answers[4].err, connect.CodeResourceExhausted)
	require.Contains(t, answers[4].err.Error(), "--api.max-queued-per-node")
	requireCode(t, answers[5].err, connect.CodeInvalidArgument)
	require.Contains(t, answers[5].err.Error(), "deadline")
	require.Equal(t, 3, b.count(`SELECT count(*) FROM commands`), "the refused creates wrote nothing")
	require.Equal(t, 3, b.count(`SELECT count(*) FROM audit_events WHERE method = 'CreateCommand'`))
}

// TestCreateCommandsShareATransaction: creates that arrive while every
// group writer waits are written together, fewer transactions than
// creates, and each caller gets its own command.
func TestCreateCommandsShareATransaction(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	nodes := []string{"node-1", "node-2", "node-3"}
	for _, n := range nodes {
		b.registerNode(n, nil)
	}
	g := b.svc.handler.group
	require.NotNil(t, g)

	// Hold the nodes so the writers' node locks wait on them.
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM nodes FOR UPDATE`)
	require.NoError(t, err)

	const calls = 40
	ids := make([]string, calls)
	errs := make([]error, calls)
	var wg sync.WaitGroup
	for i := range calls {
		wg.Go(func() {
			r, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{
				NodeId: nodes[i%len(nodes)], Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
			errs[i] = err
			if err == nil {
				ids[i] = r.Msg.GetCommand().GetId()
			}
		})
	}
	// The writers wait on the lock and the other calls wait for a writer.
	require.Eventually(t, func() bool {
		return testutil.ToFloat64(g.waiting)+testutil.ToFloat64(g.writing) == calls && testutil.ToFloat64(g.waiting) > 0
	}, 30*time.Second, 10*time.Millisecond, "the calls queue behind the busy writers")
	require.NoError(t, tx.Rollback(ctx))
	wg.Wait()

	seen := map[string]bool{}
	for i := range calls {
		require.NoError(t, errs[i], "call %d", i)
		require.NotEmpty(t, ids[i])
		require.False(t, seen[ids[i]], "each call gets its own command")
		seen[ids[i]] = true
	}
	require.Equal(t, calls, b.count(`SELECT count(*) FROM commands`))
	require.Equal(t, calls, b.count(`SELECT count(*) FROM audit_events WHERE method = 'CreateCommand'`))
	var m dto.Metric
	require.NoError(t, g.size.Write(&m))
	require.EqualValues(t, calls, m.GetHistogram().GetSampleSum(), "every create was written by a group")
	require.Less(t, m.GetHistogram().GetSampleCount(), uint64(calls/2), "groups shared their transactions")
	require.Zero(t, testutil.ToFloat64(g.waiting))
	require.Zero(t, testutil.ToFloat64(g.writing))
}
