package gateway

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestResultWithNULEndsItsCommand: a result whose error holds NUL and
// invalid UTF-8 (an old or foreign daemon) is stored sanitised and ends
// its command failed; the session is not closed.
func TestResultWithNULEndsItsCommand(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	g := startGateway(t, db, testConfig())
	creds := registerNodes(t, db, "n", 1)
	s := dialRaw(t, g.Addr())
	s.welcome(t, "n-0", creds[0])
	id := dispatchedTo(t, db, s, "n-0")
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandResult{CommandResult: &nodev1.CommandResult{
		CommandId: id, ResultId: id + "/1", ExitCode: 3, Error: "bad\x00bytes"}}}))
	s.sync(t, 1)
	require.Equal(t, "failed", commandState(t, db, id))
	var e string
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT error FROM command_results WHERE command_id = $1`, id).Scan(&e))
	require.Equal(t, "bad\uFFFDbytes", e)
	require.Equal(t, int64(1), sessionEpoch(t, db, "n-0"))
	other := dispatchedTo(t, db, s, "n-0") // the session goes on
	require.NotEmpty(t, other)
}

// TestResultRefusedByDatabaseEndsItsCommand: a result the database refuses
// for good (a started_at out of timestamptz's range, a data exception)
// is answered INVALID_ARGUMENT and its command ends failed with the
// reason, so the node's redial does not replay it and nothing loops.
func TestResultRefusedByDatabaseEndsItsCommand(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	g := startGateway(t, db, testConfig())
	creds := registerNodes(t, db, "n", 1)
	s := dialRaw(t, g.Addr())
	s.welcome(t, "n-0", creds[0])
	id := dispatchedTo(t, db, s, "n-0")
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandResult{CommandResult: &nodev1.CommandResult{
		CommandId: id, ResultId: id + "/1", StartedAt: &timestamppb.Timestamp{Seconds: -3_200_000_000_000}}}}))
	require.Equal(t, "invalid_argument", s.recvUntilErr(t, 10*time.Second).String())
	require.Equal(t, "failed", commandState(t, db, id))
	var e string
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT error FROM command_results WHERE command_id = $1`, id).Scan(&e))
	require.Contains(t, e, "could not be stored")

	// The node redials and names the command in flight: it is not replayed.
	s2 := dialRaw(t, g.Addr())
	require.NoError(t, s2.hello("n-0", creds[0], id))
	m, err := s2.recv(t, 10*time.Second)
	require.NoError(t, err)
	require.NotNil(t, m.GetWelcome())
	s2.sync(t, 1)
}
