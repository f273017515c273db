package e2e

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/daemon"
	"github.com/leasehold/leasehold/pkg/fleettest"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

const (
	outputOperatorToken = "e2e-output-operator-token-1"
	outputViewerToken   = "e2e-output-viewer-token-01"
	e2eOutputCap        = 4096
)

// controlClient calls one api process with one token.
type controlClient struct {
	controlv1connect.ControlServiceClient
	token string
}

func authed[T any](c controlClient, msg *T) *connect.Request[T] {
	r := connect.NewRequest(msg)
	r.Header().Set("Authorization", "Bearer "+c.token)
	return r
}

// testNode is an in-process daemon whose handler runs by command kind:
//
//   - "phases" writes phase one, waits for release, writes phase two;
//   - "flood" writes 3 x e2eOutputCap bytes;
//   - "block" writes a line and waits for its ctx to end.
type testNode struct {
	release chan struct{}
	mu      sync.Mutex
	stopped map[string]error // command id -> ctx.Err() seen by a "block" handler
}

var (
	phaseOne = strings.Repeat("one: stdout line\n", 20)
	phaseTwo = "two: the rest\n"
)

func (n *testNode) handle(ctx context.Context, c *nodev1.Command) daemon.Outcome {
	switch c.GetKind() {
	case "phases":
		_, _ = io.WriteString(daemon.Stdout(ctx), phaseOne[:100])
		_, _ = io.WriteString(daemon.Stderr(ctx), phaseOne[100:200])
		_, _ = io.WriteString(daemon.Stdout(ctx), phaseOne[200:])
		select {
		case <-n.release:
		case <-ctx.Done():
			return daemon.Outcome{ExitCode: 1}
		}
		_, _ = io.WriteString(daemon.Stdout(ctx), phaseTwo)
		return daemon.Outcome{Output: []byte("done")}
	case "flood":
		for range 3 * e2eOutputCap / 64 {
			_, _ = io.WriteString(daemon.Stdout(ctx), strings.Repeat("f", 63)+"\n")
		}
		return daemon.Outcome{}
	case "block":
		_, _ = io.WriteString(daemon.Stdout(ctx), "started\n")
		<-ctx.Done()
		n.mu.Lock()
		n.stopped[c.GetCommandId()] = ctx.Err()
		n.mu.Unlock()
		return daemon.Outcome{ExitCode: 130}
	}
	return daemon.Outcome{ExitCode: 2, Err: "unknown kind"}
}

func (n *testNode) stoppedErr(id string) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.stopped[id]
}

func runNode(t *testing.T, address, id, cred string, n *testNode) {
	t.Helper()
	d, err := daemon.New(daemon.Config{Address: address, NodeID: id, Credential: cred, Handler: n.handle,
		BackoffBase: 50 * time.Millisecond, BackoffMax: 500 * time.Millisecond, OutputFlush: 20 * time.Millisecond})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = d.Run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait() })
}

// readOutput streams a command's output from offset until the stream ends
// (or until want returns true, when want is not nil); it returns the bytes,
// the truncation offset (-1 when none) and the stream's error.
func readOutput(ctx context.Context, c controlClient, id string, offset int64, want func([]byte) bool) ([]byte, int64, error) {
	st, err := c.StreamCommandOutput(ctx, authed(c, &controlv1.StreamCommandOutputRequest{CommandId: id, Offset: offset}))
	if err != nil {
		return nil, -1, err
	}
	defer func() { _ = st.Close() }()
	var buf bytes.Buffer
	truncated := int64(-1)
	next := offset
	for st.Receive() {
		m := st.Msg()
		if m.GetTruncated() {
			truncated = m.GetOffset()
			continue
		}
		if m.GetOffset() != next {
			return buf.Bytes(), truncated, fmt.Errorf("piece at offset %d, want %d", m.GetOffset(), next)
		}
		buf.Write(m.GetData())
		next += int64(len(m.GetData()))
		if want != nil && want(buf.Bytes()) {
			return buf.Bytes(), truncated, nil
		}
	}
	return buf.Bytes(), truncated, st.Err()
}

// TestCommandOutputAndCancelReachTheNode runs a gateway and two api
// processes with in-process daemons: a command's output is read live from
// one api replica and resumed at an offset from the other; output past the
// gateway's cap ends in a truncation marker; CancelCommand stops a running
// handler and shows the node's confirmation; a cancel made while the node
// is offline is delivered after it reconnects.
func TestCommandOutputAndCancelReachTheNode(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ids, creds := fleettest.RegisterNodes(t, db.Pool, "out", 2)
	env := []string{"LEASEHOLD_API_TOKENS=operator:" + outputOperatorToken + ",viewer:" + outputViewerToken}
	start := func(service, name string, extra ...string) *proctest.Proc {
		args := append([]string{"--database-url", db.URL, "--http-addr", fleettest.Addr(t), "--id", name, "--log-format", "text"},
			fleettest.DBFlags(db.URL)...)
		p := proctest.Start(t, name, fleettest.Binary(t, service), env, append(args, extra...)...)
		p.WaitReady(60 * time.Second)
		return p
	}
	gwAddr, apiA, apiB := fleettest.Addr(t), fleettest.Addr(t), fleettest.Addr(t)
	start("gateway", "gw_out", append([]string{"--listen-addr", gwAddr, "--gateway.output-cap", fmt.Sprint(e2eOutputCap)}, fleettest.FastGateway...)...)
	start("api", "api_out_a", "--listen-addr", apiA, "--api.wait-poll-interval", "1s")
	start("api", "api_out_b", "--listen-addr", apiB, "--api.wait-poll-interval", "1s")
	opA := controlClient{controlv1connect.NewControlServiceClient(http.DefaultClient, "http://"+apiA), outputOperatorToken}
	viewA := controlClient{controlv1connect.NewControlServiceClient(http.DefaultClient, "http://"+apiA), outputViewerToken}
	viewB := controlClient{controlv1connect.NewControlServiceClient(http.DefaultClient, "http://"+apiB), outputViewerToken}

	node0 := &testNode{release: make(chan struct{}), stopped: map[string]error{}}
	runNode(t, "http://"+gwAddr, ids[0], creds[0], node0)
	lb := balancer(t, gwAddr)
	node1 := &testNode{release: make(chan struct{}), stopped: map[string]error{}}
	runNode(t, "http://"+lb.Addr(), ids[1], creds[1], node1)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	create := func(node, kind string) string {
		t.Helper()
		r, err := opA.CreateCommand(ctx, authed(opA, &controlv1.CreateCommandRequest{NodeId: node, Kind: kind}))
		require.NoError(t, err)
		return r.Msg.GetCommand().GetId()
	}
	get := func(id string) *controlv1.Command {
		t.Helper()
		r, err := viewB.GetCommand(ctx, authed(viewB, &controlv1.GetCommandRequest{CommandId: id}))
		require.NoError(t, err)
		return r.Msg.GetCommand()
	}

	t.Run("bad requests", func(t *testing.T) {
		_, _, err := readOutput(ctx, viewA, "x", -1, nil)
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
		require.ErrorContains(t, err, "offset")
		_, _, err = readOutput(ctx, viewA, "no such/id", 0, nil)
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
		require.ErrorContains(t, err, "command_id")
		_, _, err = readOutput(ctx, viewA, "no-such-command", 0, nil)
		require.Equal(t, connect.CodeNotFound, connect.CodeOf(err))
		_, err = viewA.CancelCommand(ctx, authed(viewA, &controlv1.CancelCommandRequest{CommandId: "x"}))
		require.Equal(t, connect.CodePermissionDenied, connect.CodeOf(err), "a viewer may read output but not cancel")
	})

	t.Run("live output resumed from another replica", func(t *testing.T) {
		id := create(ids[0], "phases")
		// Replica A: phase one arrives while the command still runs.
		got, _, err := readOutput(ctx, viewA, id, 0, func(b []byte) bool { return len(b) >= len(phaseOne) })
		require.NoError(t, err)
		require.Equal(t, phaseOne, string(got))
		require.NotEqual(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, get(id).GetState(), "read live, before the end")
		// Replica B, from an offset inside phase one, follows it to the end.
		resumeAt := int64(150)
		type read struct {
			b   []byte
			err error
		}
		done := make(chan read, 1)
		go func() {
			b, _, err := readOutput(ctx, viewB, id, resumeAt, nil)
			done <- read{b, err}
		}()
		close(node0.release)
		r := <-done
		require.NoError(t, r.err, "the stream ends cleanly once the command finished")
		require.Equal(t, (phaseOne + phaseTwo)[resumeAt:], string(r.b))
		c := get(id)
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_SUCCEEDED, c.GetState())
		require.EqualValues(t, len(phaseOne)+len(phaseTwo), c.GetOutputBytes())
		require.False(t, c.GetOutputTruncated())
	})

	t.Run("cap and truncation marker", func(t *testing.T) {
		id := create(ids[0], "flood")
		got, truncatedAt, err := readOutput(ctx, viewB, id, 0, nil)
		require.NoError(t, err)
		require.Len(t, got, e2eOutputCap)
		require.EqualValues(t, e2eOutputCap, truncatedAt)
		c := get(id)
		require.True(t, c.GetOutputTruncated())
		require.EqualValues(t, e2eOutputCap, c.GetOutputBytes())
	})

	t.Run("cancel stops the running handler and is confirmed", func(t *testing.T) {
		id := create(ids[0], "block")
		_, _, err := readOutput(ctx, viewA, id, 0, func(b []byte) bool { return string(b) == "started\n" })
		require.NoError(t, err)
		r, err := opA.CancelCommand(ctx, authed(opA, &controlv1.CancelCommandRequest{CommandId: id}))
		require.NoError(t, err)
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_CANCELLED, r.Msg.GetCommand().GetState())
		require.NotNil(t, r.Msg.GetCommand().GetCancelRequestedAt())
		require.Eventually(t, func() bool { return get(id).GetCancelConfirmed() }, time.Minute, 20*time.Millisecond)
		require.ErrorIs(t, node0.stoppedErr(id), context.Canceled, "the handler's ctx was cancelled")
		c := get(id)
		require.Equal(t, "stopped", c.GetCancelOutcome())
		require.Equal(t, controlv1.CommandState_COMMAND_STATE_CANCELLED, c.GetState())
		w, err := viewB.WaitCommand(ctx, authed(viewB, &controlv1.WaitCommandRequest{CommandId: id}))
		require.NoError(t, err)
		require.Equal(t, "cancelled by CancelCommand", w.Msg.GetResult().GetError())
		// The output stream of a cancelled, confirmed command ends.
		got, _, err := readOutput(ctx, viewB, id, 0, nil)
		require.NoError(t, err)
		require.Equal(t, "started\n", string(got))
		var audited int
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM audit_events WHERE method = 'CancelCommand' AND target_id = $1 AND outcome = 'ok'`, id).Scan(&audited))
		require.Equal(t, 1, audited, "the cancel is in the audit trail")
	})

	t.Run("cancel while the node is offline is delivered after it reconnects", func(t *testing.T) {
		id := create(ids[1], "block")
		_, _, err := readOutput(ctx, viewA, id, 0, func(b []byte) bool { return string(b) == "started\n" })
		require.NoError(t, err)
		lb.Refuse()
		lb.CutAll()
		require.Eventually(t, func() bool {
			n, err := queryInt(db.Pool, `SELECT count(*) FROM node_sessions WHERE node_id = $1 AND state = 'connected'`, ids[1])
			return err == nil && n == 0
		}, time.Minute, 20*time.Millisecond, "the gateway sees the node go")
		r, err := opA.CancelCommand(ctx, authed(opA, &controlv1.CancelCommandRequest{CommandId: id}))
		require.NoError(t, err)
		require.False(t, r.Msg.GetCommand().GetCancelConfirmed())
		require.NoError(t, node1.stoppedErr(id), "the handler runs on while its node is offline")
		lb.Restore()
		require.Eventually(t, func() bool { return get(id).GetCancelConfirmed() }, time.Minute, 20*time.Millisecond)
		require.ErrorIs(t, node1.stoppedErr(id), context.Canceled)
		require.Equal(t, "stopped", get(id).GetCancelOutcome())
	})
}
