package api

import (
	"context"
	"encoding/base64"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
)

func TestCreateCommandIdempotencyKey(t *testing.T) {
	t.Parallel()
	testIdempotencyKey(t, setup(t))
}

// TestCreateCommandIdempotencyKeyOnTheConstraint: the same behaviour on
// the schema before the idempotency index became partial (a unique
// constraint over every command); the api's insert must work on both, so
// the api and the migration can be upgraded in either order.
func TestCreateCommandIdempotencyKeyOnTheConstraint(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := b.db.Pool.Exec(ctxT(t), `
DROP INDEX commands_idempotency_idx;
ALTER TABLE commands ADD CONSTRAINT commands_node_id_idempotency_key_key UNIQUE (node_id, idempotency_key)`)
	require.NoError(t, err)
	testIdempotencyKey(t, b)
}

func testIdempotencyKey(t *testing.T, b *bundle) {
	ctx := ctxT(t)
	b.registerNode("node-1", nil)
	req := &controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`), IdempotencyKey: "k-1"}

	first, err := b.operator.CreateCommand(ctx, connect.NewRequest(req))
	require.NoError(t, err)
	require.True(t, first.Msg.GetCreated())
	c := first.Msg.GetCommand()
	require.Equal(t, controlv1.CommandState_COMMAND_STATE_PENDING, c.GetState())
	require.Equal(t, "k-1", c.GetIdempotencyKey())
	// The default timeout counts from the database clock.
	require.InDelta(t, time.Hour.Seconds(), c.GetDeadline().AsTime().Sub(c.GetCreatedAt().AsTime()).Seconds(), 1)

	second, err := b.operator.CreateCommand(ctx, connect.NewRequest(req))
	require.NoError(t, err)
	require.False(t, second.Msg.GetCreated())
	require.Equal(t, c.GetId(), second.Msg.GetCommand().GetId())
	require.Equal(t, 1, b.count(`SELECT count(*) FROM commands`))

	// The same key with other content is a conflict; the key is per node.
	_, err = b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["false"]}`), IdempotencyKey: "k-1"}))
	ce := requireConnectError(t, err, connect.CodeAlreadyExists)
	require.Contains(t, ce.Message(), "idempotency_key")
	b.registerNode("node-2", nil)
	other, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-2", Kind: "exec", Payload: []byte(`{"argv":["true"]}`), IdempotencyKey: "k-1"}))
	require.NoError(t, err)
	require.True(t, other.Msg.GetCreated())

	// Without a key every call creates; timeout and deadline set the deadline.
	t1, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "reboot",
		Expiry: &controlv1.CreateCommandRequest_Timeout{Timeout: durationpb.New(90 * time.Second)}}))
	require.NoError(t, err)
	require.InDelta(t, 90, t1.Msg.GetCommand().GetDeadline().AsTime().Sub(t1.Msg.GetCommand().GetCreatedAt().AsTime()).Seconds(), 1)
	dl := time.Now().Add(2 * time.Hour).Truncate(time.Microsecond)
	t2, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "reboot",
		Expiry: &controlv1.CreateCommandRequest_Deadline{Deadline: timestamppb.New(dl)}}))
	require.NoError(t, err)
	require.True(t, t2.Msg.GetCreated())
	require.True(t, dl.Equal(t2.Msg.GetCommand().GetDeadline().AsTime()), "deadline %s", t2.Msg.GetCommand().GetDeadline().AsTime())
	require.Equal(t, 4, b.count(`SELECT count(*) FROM commands`))

	// A deadline in the past, or unknown node, writes nothing.
	_, err = b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "reboot",
		Expiry: &controlv1.CreateCommandRequest_Deadline{Deadline: timestamppb.New(time.Now().Add(-time.Minute))}}))
	ce = requireConnectError(t, err, connect.CodeInvalidArgument)
	require.Contains(t, ce.Message(), "deadline:")
	_, err = b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "ghost", Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
	requireCode(t, err, connect.CodeNotFound)
	require.Equal(t, 4, b.count(`SELECT count(*) FROM commands`))

	got, err := b.viewer.GetCommand(ctx, connect.NewRequest(&controlv1.GetCommandRequest{CommandId: c.GetId()}))
	require.NoError(t, err)
	require.Equal(t, c.GetPayload(), got.Msg.GetCommand().GetPayload())
	require.Nil(t, got.Msg.GetResult())
	_, err = b.viewer.GetCommand(ctx, connect.NewRequest(&controlv1.GetCommandRequest{CommandId: "ghost"}))
	requireCode(t, err, connect.CodeNotFound)
}

func TestCancelCommand(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	b.registerNode("node-1", nil)
	mk := func() string {
		r, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
		require.NoError(t, err)
		return r.Msg.GetCommand().GetId()
	}
	pending, running, done := mk(), mk(), mk()
	b.exec(`UPDATE commands SET state = 'acknowledged', dispatched_at = compute_now(), acked_at = compute_now() WHERE id = $1`, running)
	b.exec(`UPDATE commands SET state = 'succeeded', finished_at = compute_now() WHERE id = $1`, done)

	for _, id := range []string{pending, running} {
		r, err := b.operator.CancelCommand(ctx, connect.NewRequest(&controlv1.CancelCommandRequest{CommandId: id}))
		require.NoError(t, err)
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_CANCELLED, r.Msg.GetCommand().GetState())
		// Only a command its node was given is asked of the node.
		require.Equal(t, id == running, r.Msg.GetCommand().GetCancelRequestedAt() != nil, id)
		require.False(t, r.Msg.GetCommand().GetCancelConfirmed())
		// Again: unchanged, not an error.
		r, err = b.operator.CancelCommand(ctx, connect.NewRequest(&controlv1.CancelCommandRequest{CommandId: id}))
		require.NoError(t, err)
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_CANCELLED, r.Msg.GetCommand().GetState())
	}
	r, err := b.operator.CancelCommand(ctx, connect.NewRequest(&controlv1.CancelCommandRequest{CommandId: done}))
	require.NoError(t, err)
	require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, r.Msg.GetCommand().GetState())
	require.Nil(t, r.Msg.GetCommand().GetCancelRequestedAt())
	_, err = b.operator.CancelCommand(ctx, connect.NewRequest(&controlv1.CancelCommandRequest{CommandId: "ghost"}))
	requireCode(t, err, connect.CodeNotFound)

	// Each call that found its command is audited in its transaction.
	require.Equal(t, 2, b.count(`SELECT count(*) FROM audit_events WHERE method = 'CancelCommand' AND outcome = 'ok'`))
	require.Equal(t, 3, b.count(`SELECT count(*) FROM audit_events WHERE method = 'CancelCommand' AND outcome = 'unchanged'`))
	require.Equal(t, 1, b.count(`SELECT count(*) FROM audit_events WHERE method = 'CancelCommand' AND target_id = $1
	   AND outcome = 'ok' AND detail->>'deliver_to_node' = 'true'`, running))
	require.Zero(t, b.count(`SELECT count(*) FROM audit_events WHERE target_id = 'ghost'`))

	// The node's confirmation and the stored output show on the command.
	b.exec(`UPDATE commands SET cancel_confirmed_at = compute_now(), cancel_outcome = 'stopped' WHERE id = $1`, running)
	b.exec(`INSERT INTO command_output (command_id, "offset", stream, data) VALUES ($1, 0, 'stdout', 'abc'), ($1, 3, 'stderr', 'de')`, running)
	g, err := b.viewer.GetCommand(ctx, connect.NewRequest(&controlv1.GetCommandRequest{CommandId: running}))
	require.NoError(t, err)
	require.True(t, g.Msg.GetCommand().GetCancelConfirmed())
	require.Equal(t, "stopped", g.Msg.GetCommand().GetCancelOutcome())
	require.EqualValues(t, 5, g.Msg.GetCommand().GetOutputBytes())
	require.False(t, g.Msg.GetCommand().GetOutputTruncated())
	b.exec(`INSERT INTO command_output (command_id, "offset", stream, data) VALUES ($1, 5, 'truncated', '')`, running)
	l, err := b.viewer.ListCommands(ctx, connect.NewRequest(&controlv1.ListCommandsRequest{NodeId: "node-1"}))
	require.NoError(t, err)
	for _, c := range l.Msg.GetCommands() {
		require.Equal(t, c.GetId() == running, c.GetOutputTruncated(), c.GetId())
	}
}

func TestWaitCommand(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	b.registerNode("node-1", nil)
	r, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
	require.NoError(t, err)
	id := r.Msg.GetCommand().GetId()

	// Times out: the command as it stands, no error.
	start := time.Now()
	w, err := b.viewer.WaitCommand(ctx, connect.NewRequest(&controlv1.WaitCommandRequest{CommandId: id, Timeout: durationpb.New(300 * time.Millisecond)}))
	require.NoError(t, err)
	require.Equal(t, controlv1.CommandState_COMMAND_STATE_PENDING, w.Msg.GetCommand().GetState())
	require.GreaterOrEqual(t, time.Since(start), 300*time.Millisecond)

	// A gateway stores the result while the caller waits.
	go func() {
		// Store it once the call below is waiting (the waiter's gauge says
		// so), or after 20 s regardless: the call's own assertions then fail.
		for deadline := time.Now().Add(20 * time.Second); b.waitingCommands() < 1 && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond) // poll interval of a loop bounded by its deadline
		}
		_, _ = b.db.Pool.Exec(ctx, `
WITH r AS (INSERT INTO command_results (node_id, id, command_id, exit_code, output, gateway_id, session_epoch)
           VALUES ('node-1', 'res-1', $1, 0, 'hello', 'gw-1', 1))
UPDATE commands SET state = 'succeeded', finished_at = compute_now() WHERE id = $1`, id)
	}()
	start = time.Now()
	w, err = b.viewer.WaitCommand(ctx, connect.NewRequest(&controlv1.WaitCommandRequest{CommandId: id, Timeout: durationpb.New(20 * time.Second)}))
	require.NoError(t, err)
	require.Less(t, time.Since(start), 5*time.Second)
	require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, w.Msg.GetCommand().GetState())
	require.Equal(t, "res-1", w.Msg.GetResult().GetResultId())
	require.Equal(t, []byte("hello"), w.Msg.GetResult().GetOutput())

	// Terminal already: at once. The caller's own deadline bounds the wait.
	start = time.Now()
	_, err = b.viewer.WaitCommand(ctx, connect.NewRequest(&controlv1.WaitCommandRequest{CommandId: id}))
	require.NoError(t, err)
	require.Less(t, time.Since(start), time.Second)
	r, err = b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
	require.NoError(t, err)
	short := b.client(viewerToken, connect.WithInterceptors())
	shortCtx, cancel := contextWithTimeout(ctx, time.Second)
	defer cancel()
	w, err = short.WaitCommand(shortCtx, connect.NewRequest(&controlv1.WaitCommandRequest{CommandId: r.Msg.GetCommand().GetId(), Timeout: durationpb.New(MaxWait)}))
	require.NoError(t, err, "answers before the caller's deadline")
	require.Equal(t, controlv1.CommandState_COMMAND_STATE_PENDING, w.Msg.GetCommand().GetState())
	_, err = b.viewer.WaitCommand(ctx, connect.NewRequest(&controlv1.WaitCommandRequest{CommandId: "ghost"}))
	requireCode(t, err, connect.CodeNotFound)
}

// TestWaiterIsWokenWhenTheCommandFinishes: with a poll interval of an
// hour, only the notification a gateway's group commit sends
// (leasehold_command_done) can wake the waiter.
func TestWaiterIsWokenWhenTheCommandFinishes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	if b.db.DirectURL == "" {
		t.Skip("no direct connection to LISTEN on")
	}
	ctx := ctxT(t)
	b.registerNode("node-1", nil)
	r, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
	require.NoError(t, err)
	id := r.Msg.GetCommand().GetId()

	w := newWaiter(b.db.Pool, b.db.DirectURL, time.Hour, slog.New(slog.DiscardHandler))
	wctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); w.run(wctx) }()
	defer func() { stop(); <-done }()
	require.Eventually(t, w.listening.Load, 10*time.Second, 5*time.Millisecond)
	finished, unregister := w.register(id)
	defer unregister()

	_, err = b.db.Pool.Exec(ctx, `
WITH r AS (INSERT INTO command_results (node_id, id, command_id, exit_code, output, gateway_id, session_epoch)
           VALUES ('node-1', 'res-1', $1, 0, 'hello', 'gw-1', 1)),
     f AS (UPDATE commands SET state = 'succeeded', finished_at = compute_now() WHERE id = $1)
SELECT pg_notify('leasehold_command_done', '')`, id)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		select {
		case <-finished:
			return true
		default:
			return false
		}
	}, 30*time.Second, 5*time.Millisecond, "woken by the notification")
}

func TestListCommandsNewestFirstAcrossPages(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	b.registerNode("node-1", nil)
	b.registerNode("node-2", nil)
	// 25 commands with distinct, and 5 with equal, creation times.
	b.exec(`INSERT INTO commands (node_id, kind, created_at)
SELECT CASE WHEN i % 2 = 0 THEN 'node-1' ELSE 'node-2' END, 'exec', compute_now() - make_interval(secs => i)
  FROM generate_series(1, 25) i`)
	b.exec(`INSERT INTO commands (node_id, kind, created_at)
SELECT 'node-1', 'tie', '2020-01-01T00:00:00Z' FROM generate_series(1, 5)`)

	list := func(req *controlv1.ListCommandsRequest) []*controlv1.Command {
		var out []*controlv1.Command
		for {
			resp, err := b.viewer.ListCommands(ctx, connect.NewRequest(req))
			require.NoError(t, err)
			require.LessOrEqual(t, len(resp.Msg.GetCommands()), int(req.GetPageSize()))
			out = append(out, resp.Msg.GetCommands()...)
			if req.PageToken = resp.Msg.GetNextPageToken(); req.PageToken == "" {
				return out
			}
		}
	}
	all := list(&controlv1.ListCommandsRequest{PageSize: 7})
	require.Len(t, all, 30)
	seen := map[string]bool{}
	for i, c := range all {
		require.False(t, seen[c.GetId()], "duplicate %s", c.GetId())
		seen[c.GetId()] = true
		if i > 0 {
			require.False(t, c.GetCreatedAt().AsTime().After(all[i-1].GetCreatedAt().AsTime()), "newest first")
		}
	}
	require.Len(t, list(&controlv1.ListCommandsRequest{PageSize: 4, NodeId: "node-1"}), 12+5)
	require.Len(t, list(&controlv1.ListCommandsRequest{PageSize: 100, State: controlv1.CommandState_COMMAND_STATE_PENDING}), 30)
	require.Empty(t, list(&controlv1.ListCommandsRequest{PageSize: 100, State: controlv1.CommandState_COMMAND_STATE_RUNNING}))

	// A token of another method is refused.
	nodes, err := b.viewer.ListNodes(ctx, connect.NewRequest(&controlv1.ListNodesRequest{PageSize: 1}))
	require.NoError(t, err)
	_, err = b.viewer.ListCommands(ctx, connect.NewRequest(&controlv1.ListCommandsRequest{PageToken: nodes.Msg.GetNextPageToken()}))
	ce := requireConnectError(t, err, connect.CodeInvalidArgument)
	require.Contains(t, ce.Message(), "page_token:")
}

func TestListCommandsBoundsPayloadBytesPerPage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	b.registerNode("node-1", nil)
	big := make([]byte, maxPayloadBytes)
	for i := range 6 {
		_, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: fmt.Sprintf("k%d", i), Payload: big}))
		require.NoError(t, err)
	}
	resp, err := b.viewer.ListCommands(ctx, connect.NewRequest(&controlv1.ListCommandsRequest{PageSize: 100}))
	require.NoError(t, err)
	require.Len(t, resp.Msg.GetCommands(), maxListPayloadBytes/maxPayloadBytes)
	require.NotEmpty(t, resp.Msg.GetNextPageToken())
	rest, err := b.viewer.ListCommands(ctx, connect.NewRequest(&controlv1.ListCommandsRequest{PageSize: 100, PageToken: resp.Msg.GetNextPageToken()}))
	require.NoError(t, err)
	require.Len(t, rest.Msg.GetCommands(), 6-maxListPayloadBytes/maxPayloadBytes)
}

func TestCreateCommandConcurrentSameKeyCreatesOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	b.registerNode("node-1", nil)
	const n = 8
	type out struct {
		id      string
		created bool
		err     error
	}
	results := make(chan out, n)
	for range n {
		go func() {
			r, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["x"]}`), IdempotencyKey: "race"}))
			if err != nil {
				results <- out{err: err}
				return
			}
			results <- out{id: r.Msg.GetCommand().GetId(), created: r.Msg.GetCreated()}
		}()
	}
	ids, created := map[string]bool{}, 0
	for range n {
		r := <-results
		require.NoError(t, r.err)
		ids[r.id] = true
		if r.created {
			created++
		}
	}
	require.Len(t, ids, 1)
	require.Equal(t, 1, created)
	require.Equal(t, 1, b.count(`SELECT count(*) FROM commands`))
}

// TestCreateCommandTypedPayload: a typed kind's payload (pkg/cmdkind) is
// parsed at CreateCommand; a bad one is INVALID_ARGUMENT naming the field,
// and nothing is written (no command, no audit event). Other kinds stay
// opaque: any bytes are stored as they are.
func TestCreateCommandTypedPayload(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := ctxT(t)
	b.registerNode("node-1", nil)
	bad := []struct{ kind, payload, msg string }{
		{"exec", ``, "payload.argv: must not be empty"},
		{"exec", `{"argv":[]}`, "payload.argv: must not be empty"},
		{"exec", `uptime`, "payload: not valid JSON for kind exec: "},
		{"exec", `{"argv":["ls"],"shell":true}`, "payload: not valid JSON for kind exec: "},
		{"exec", `{"argv":["ls"],"env":{"1X":"y"}}`, `payload.env: name "1X" must match [A-Za-z_][A-Za-z0-9_]*`},
		{"exec", `{"argv":["ls"],"timeout":"90000s"}`, "payload.timeout: must be positive and at most 24h0m0s"},
		{"exec", `{"argv":["ls"],"user":"-x"}`, `payload.user: "-x" must be a numeric id or a name`},
		{"script", `{"interpreter":"sh"}`, "payload.script: must not be empty"},
		{"file.put", `{"path":"/etc/../x"}`, "payload.path: must be absolute and clean"},
		{"file.put", `{"path":"/x","mode":4096}`, "payload.mode: must be at most 07777"},
		{"file.put", `{"path":"/x","sha256":"ABC"}`, "payload.sha256: must be 64 lowercase hex digits"},
		{"file.get", `{"path":"relative"}`, "payload.path: must be absolute and clean"},
		{"facts", `{"x":1}`, "payload: not valid JSON for kind facts"},
		{"reboot", `{"delay":"7200s"}`, "payload.delay: must be in 0s..1h0m0s"},
	}
	for _, c := range bad {
		_, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: c.kind, Payload: []byte(c.payload)}))
		ce := requireConnectError(t, err, connect.CodeInvalidArgument, "%s %s", c.kind, c.payload)
		require.True(t, strings.HasPrefix(ce.Message(), c.msg), "%s %s: %q does not start with %q", c.kind, c.payload, ce.Message(), c.msg)
	}
	// The same over JSON, as curl sends it (payload base64).
	code, body := b.postJSON("/leasehold.control.v1.ControlService/CreateCommand", operatorToken,
		`{"nodeId":"node-1","kind":"exec","payload":"`+base64.StdEncoding.EncodeToString([]byte(`{"argv":[""]}`))+`"}`)
	require.Equal(t, http.StatusBadRequest, code)
	require.Equal(t, "invalid_argument", body["code"])
	require.Equal(t, "payload.argv[0]: must name a program", body["message"])
	require.Zero(t, b.count(`SELECT count(*) FROM commands`))
	require.Zero(t, b.count(`SELECT count(*) FROM audit_events WHERE method = 'CreateCommand'`))

	good := []struct{ kind, payload string }{
		{"exec", `{"argv":["uname","-a"],"env":{"LC_ALL":"C"},"timeout":"30s"}`},
		{"script", `{"interpreter":"/bin/sh","script":"echo hi"}`},
		{"file.put", `{"path":"/etc/motd","content":"aGk=","mode":420}`},
		{"file.get", `{"path":"/etc/hostname"}`},
		{"facts", ``},
		{"reboot", `{"delay":"60s","reason":"kernel"}`},
		{"custom.kind", "not json \x00 at all"},
	}
	for _, c := range good {
		r, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: c.kind, Payload: []byte(c.payload)}))
		require.NoError(t, err, "%s %s", c.kind, c.payload)
		require.Equal(t, c.payload, string(r.Msg.GetCommand().GetPayload()), "the payload is stored as sent")
	}
	require.Equal(t, len(good), b.count(`SELECT count(*) FROM commands`))
}
