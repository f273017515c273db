package gateway

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgnotify"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func outputMsg(id string, off int64, stream nodev1.OutputStream, data string) *nodev1.ConnectRequest {
	return &nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandOutput{CommandOutput: &nodev1.CommandOutput{
		CommandId: id, Offset: off, Stream: stream, Data: []byte(data)}}}
}

// sync sends a heartbeat and waits for its ack: every message sent before
// it has been handled (a result is committed; output queued before it is).
func (s *rawSession) sync(t testing.TB, seq uint64) {
	t.Helper()
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Heartbeat{Heartbeat: &nodev1.Heartbeat{Sequence: seq}}}))
	for {
		m, err := s.recv(t, 10*time.Second)
		require.NoError(t, err)
		if m.GetHeartbeatAck().GetSequence() == seq {
			return
		}
	}
}

type storedPiece struct {
	off    int64
	stream string
	data   []byte
}

func storedOutput(t testing.TB, db *pgtest.DB, id string) []storedPiece {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), `SELECT "offset", stream, data FROM command_output WHERE command_id = $1 ORDER BY "offset"`, id)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (storedPiece, error) {
		var p storedPiece
		return p, r.Scan(&p.off, &p.stream, &p.data)
	})
	require.NoError(t, err)
	return out
}

// TestOutputStoredOnceCappedAndNotified: pieces are stored by offset once,
// cut at the cap with one truncation marker, pieces past the cap are
// dropped, and the group commit NOTIFYs leasehold_command_output with the
// command id only.
func TestOutputStoredOnceCappedAndNotified(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	cfg := testConfig()
	cfg.OutputCap = 1024
	g := startGateway(t, db, cfg)
	creds := registerNodes(t, db, "n", 1)
	ctx := context.Background()
	var listener *pgx.Conn
	if db.DirectURL != "" { // without LISTEN (PgBouncer, nolisten) only the storage is checked
		var err error
		listener, err = pgx.Connect(ctx, db.DirectURL)
		require.NoError(t, err)
		defer func() { _ = listener.Close(ctx) }()
		_, err = listener.Exec(ctx, "LISTEN "+pgnotify.CommandOutput)
		require.NoError(t, err)
	}

	s := dialRaw(t, g.Addr())
	s.welcome(t, "n-0", creds[0])
	id := insertCommand(t, db, "n-0", "exec")
	m, err := s.recv(t, 10*time.Second)
	require.NoError(t, err)
	require.Equal(t, id, m.GetCommand().GetCommandId())

	out, errs := nodev1.OutputStream_OUTPUT_STREAM_STDOUT, nodev1.OutputStream_OUTPUT_STREAM_STDERR
	big := strings.Repeat("b", 2000)
	for _, msg := range []*nodev1.ConnectRequest{
		outputMsg(id, 0, out, "hello "),
		outputMsg(id, 6, errs, "err"),
		outputMsg(id, 0, out, "hello "),  // re-sent: stored once
		outputMsg(id, 9, out, big),       // crosses the cap
		outputMsg(id, 2009, out, "late"), // past the cap
	} {
		require.NoError(t, s.stream.Send(msg))
	}
	s.sync(t, 1)
	require.Eventually(t, func() bool { return len(storedOutput(t, db, id)) == 4 }, 10*time.Second, 10*time.Millisecond)
	got := storedOutput(t, db, id)
	require.Equal(t, storedPiece{0, "stdout", []byte("hello ")}, got[0])
	require.Equal(t, storedPiece{6, "stderr", []byte("err")}, got[1])
	require.Equal(t, storedPiece{9, "stdout", bytes.Repeat([]byte("b"), 1024-9)}, got[2])
	require.Equal(t, storedPiece{1024, "truncated", []byte{}}, got[3])

	if listener == nil {
		return
	}
	nctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	n, err := listener.WaitForNotification(nctx)
	require.NoError(t, err)
	require.Equal(t, id, n.Payload, "the payload names the command, never carries output")
}

// TestOutputAndCancelAckRefusals: output or a cancel ack for another
// node's command closes the session PERMISSION_DENIED and writes nothing;
// a malformed piece is INVALID_ARGUMENT.
func TestOutputAndCancelAckRefusals(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	g := startGateway(t, db, testConfig())
	creds := registerNodes(t, db, "n", 2)
	other := insertCommand(t, db, "n-1", "exec")
	_, err := db.Pool.Exec(context.Background(), `UPDATE commands SET state = 'cancelled', cancel_requested_at = compute_now() WHERE id = $1`, other)
	require.NoError(t, err)
	cases := map[string]struct {
		msg  *nodev1.ConnectRequest
		code connect.Code
	}{
		"output for another node's command": {outputMsg(other, 0, nodev1.OutputStream_OUTPUT_STREAM_STDOUT, "x"), connect.CodePermissionDenied},
		"cancel ack for another node's command": {&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CancelAck{CancelAck: &nodev1.CancelAck{
			CommandId: other, Outcome: nodev1.CancelOutcome_CANCEL_OUTCOME_STOPPED}}}, connect.CodePermissionDenied},
		"output without a stream":     {outputMsg(other, 0, nodev1.OutputStream_OUTPUT_STREAM_UNSPECIFIED, "x"), connect.CodeInvalidArgument},
		"output at a negative offset": {outputMsg(other, -1, nodev1.OutputStream_OUTPUT_STREAM_STDOUT, "x"), connect.CodeInvalidArgument},
		"cancel ack without an outcome": {&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CancelAck{CancelAck: &nodev1.CancelAck{
			CommandId: other}}}, connect.CodeInvalidArgument},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			s := dialRaw(t, g.Addr())
			s.welcome(t, "n-0", creds[0])
			require.NoError(t, s.stream.Send(c.msg))
			require.Equal(t, c.code, s.recvUntilErr(t, 10*time.Second))
			require.Empty(t, storedOutput(t, db, other))
			var confirmed bool
			require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT cancel_confirmed_at IS NOT NULL FROM commands WHERE id = $1`, other).Scan(&confirmed))
			require.False(t, confirmed)
		})
	}
}

// cancelInDB does what the api's CancelCommand does to a dispatched command.
func cancelInDB(t testing.TB, db *pgtest.DB, id string) {
	t.Helper()
	tag, err := db.Pool.Exec(context.Background(), `
UPDATE commands SET state = 'cancelled', finished_at = compute_now(), cancel_requested_at = compute_now()
 WHERE id = $1 AND state IN ('dispatched', 'acknowledged')`, id)
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())
}

func nextCancel(t testing.TB, s *rawSession) string {
	t.Helper()
	for {
		m, err := s.recv(t, 10*time.Second)
		require.NoError(t, err)
		if c := m.GetCancelCommand(); c != nil {
			return c.GetCommandId()
		}
	}
}

// TestCancelDeliveredLiveAndAfterHello: a cancel of a command whose node
// is connected is sent on its session (found by the dispatch poll here);
// one whose node is offline is sent right after the next Welcome, and
// again at every new session until the node acknowledges it; the ack
// records the outcome once.
func TestCancelDeliveredLiveAndAfterHello(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	g := startGateway(t, db, testConfig())
	creds := registerNodes(t, db, "n", 2)
	ctx := context.Background()

	s := dialRaw(t, g.Addr())
	s.welcome(t, "n-0", creds[0])
	live := insertCommand(t, db, "n-0", "exec")
	m, err := s.recv(t, 10*time.Second)
	require.NoError(t, err)
	require.Equal(t, live, m.GetCommand().GetCommandId())
	cancelInDB(t, db, live)
	require.Equal(t, live, nextCancel(t, s))
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CancelAck{CancelAck: &nodev1.CancelAck{
		CommandId: live, Outcome: nodev1.CancelOutcome_CANCEL_OUTCOME_STOPPED}}}))
	require.Eventually(t, func() bool {
		var outcome *string
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT CASE WHEN cancel_confirmed_at IS NOT NULL THEN cancel_outcome END FROM commands WHERE id = $1`, live).Scan(&outcome))
		return outcome != nil && *outcome == "stopped"
	}, 10*time.Second, 10*time.Millisecond)

	// Offline at cancel time.
	s1 := dialRaw(t, g.Addr())
	s1.welcome(t, "n-1", creds[1])
	offline := insertCommand(t, db, "n-1", "exec")
	m, err = s1.recv(t, 10*time.Second)
	require.NoError(t, err)
	require.Equal(t, offline, m.GetCommand().GetCommandId())
	s1.cancel()
	require.Eventually(t, func() bool { return !g.holds("n-1") }, 10*time.Second, 10*time.Millisecond)
	cancelInDB(t, db, offline)

	for epoch := range 2 { // unacknowledged: sent again on the next session
		s2 := dialRaw(t, g.Addr())
		s2.welcome(t, "n-1", creds[1])
		m, err := s2.recv(t, 10*time.Second)
		require.NoError(t, err)
		require.Equal(t, offline, m.GetCancelCommand().GetCommandId(), "session %d: the cancel comes right after Welcome, and the cancelled command is not replayed", epoch)
		if epoch == 0 {
			s2.cancel()
			require.Eventually(t, func() bool { return !g.holds("n-1") }, 10*time.Second, 10*time.Millisecond)
			continue
		}
		require.NoError(t, s2.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CancelAck{CancelAck: &nodev1.CancelAck{
			CommandId: offline, Outcome: nodev1.CancelOutcome_CANCEL_OUTCOME_ALREADY_FINISHED}}}))
		s2.sync(t, 1)
	}
	require.Eventually(t, func() bool {
		var outcome *string
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT CASE WHEN cancel_confirmed_at IS NOT NULL THEN cancel_outcome END FROM commands WHERE id = $1`, offline).Scan(&outcome))
		return outcome != nil && *outcome == "already_finished"
	}, 10*time.Second, 10*time.Millisecond)
}
