package gateway

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/leasehold/leasehold/pkg/daemon"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestResultWithNULEndsItsCommand: a result whose error holds NUL and
// invalid UTF-8 (an old or foreign daemon) is stored sanitised and ends
// its command failed; the session is not closed.
func TestResultWithNULEndsItsCommand(t *testing.T) {
	t.Parallel()
	db, _, s := oneNodeSession(t, testConfig())
	id := dispatchedTo(t, db, s, "n-0")
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandResult{CommandResult: &nodev1.CommandResult{
		CommandId: id, ResultId: id + "/1", ExitCode: 3, Error: "bad\x00bytes"}}}))
	s.sync(t, 1)
	require.Equal(t, "failed", commandState(t, db, id))
	var e string
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT error FROM command_results_all WHERE command_id = $1`, id).Scan(&e))
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
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT error FROM command_results_all WHERE command_id = $1`, id).Scan(&e))
	require.Contains(t, e, "could not be stored")

	// The node redials and names the command in flight: it is not replayed.
	s2 := dialRaw(t, g.Addr())
	require.NoError(t, s2.hello("n-0", creds[0], id))
	m, err := s2.recv(t, 10*time.Second)
	require.NoError(t, err)
	require.NotNil(t, m.GetWelcome())
	s2.sync(t, 1)
}

// TestDaemonRefusedResultIsNotResent: a real daemon whose journal holds a
// result the database refuses for good (journalled by an older daemon)
// sends it once: the gateway fails the command and ends the session
// INVALID_ARGUMENT, the daemon redials, the command is not replayed, and
// the daemon runs the next command on the new session.
func TestDaemonRefusedResultIsNotResent(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	g := startGateway(t, db, testConfig())
	creds := registerNodes(t, db, "n", 1)
	bad := insertCommand(t, db, "n-0", "exec")
	j := daemon.NewMemoryJournal()
	require.NoError(t, j.Record(bad, &nodev1.CommandResult{CommandId: bad, ResultId: bad + "/1",
		StartedAt: &timestamppb.Timestamp{Seconds: -3_200_000_000_000}}))
	d, err := daemon.New(daemon.Config{Address: "http://" + g.Addr(), NodeID: "n-0", Credential: creds[0], Handler: noopHandler, Journal: j})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = d.Run(ctx) })
	defer func() { cancel(); wg.Wait() }()

	require.Eventually(t, func() bool { return commandState(t, db, bad) == "failed" && d.Stats().Welcomes >= 2 },
		30*time.Second, 20*time.Millisecond, "the command fails and the daemon redials")
	// A replay would be sent right after the Welcome, before this one.
	next := insertCommand(t, db, "n-0", "exec")
	require.Eventually(t, func() bool { return commandState(t, db, next) == "succeeded" }, 30*time.Second, 20*time.Millisecond)
	st := d.Stats()
	require.Equal(t, int64(1), st.Replays, "the refused result was sent once")
	require.Equal(t, int64(2), st.Welcomes, "one redial")
	var n int
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM command_results_all WHERE command_id = $1`, bad).Scan(&n))
	require.Equal(t, 1, n)
}
