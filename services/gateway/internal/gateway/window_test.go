package gateway

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// windowConfig is a test configuration whose dispatch poll never fires
// within a test, so every dispatch here is woken by a Hello or a result,
// and whose heartbeat is long enough that a busy machine's pauses between
// the test's messages do not close the session as silent.
func windowConfig(window int) Config {
	cfg := testConfig()
	cfg.NodeWindow = window
	cfg.DispatchPoll = time.Hour
	cfg.HeartbeatInterval, cfg.SessionLease = time.Minute, 5*time.Minute
	return cfg
}

// windowCase is a gateway with a node window and node n-0 registered with
// pending commands, ids in dispatch order.
type windowCase struct {
	g    *Gateway
	db   *pgtest.DB
	cred string
	ids  []string
}

func newWindowCase(t *testing.T, window, commands int) *windowCase {
	t.Helper()
	db := pgtest.NewDB(t)
	c := &windowCase{g: startGateway(t, db, windowConfig(window)), db: db}
	c.cred = registerNodes(t, db, "n", 1)[0]
	c.ids = insertOrdered(t, db, "n-0", commands)
	return c
}

// connect opens a session for n-0 and waits for its Welcome.
func (c *windowCase) connect(t *testing.T) *rawSession {
	t.Helper()
	s := dialRaw(t, c.g.Addr())
	s.welcome(t, "n-0", c.cred)
	return s
}

// insertOrdered inserts n pending commands for nodeID, one second apart on
// the database clock, and returns their ids in dispatch order.
func insertOrdered(t *testing.T, db *pgtest.DB, nodeID string, n int) []string {
	t.Helper()
	ids := make([]string, n)
	for k := range ids {
		require.NoError(t, db.Pool.QueryRow(context.Background(),
			`INSERT INTO commands (node_id, kind, created_at) VALUES ($1, 'exec', compute_now() + make_interval(secs => $2)) RETURNING id`,
			nodeID, k).Scan(&ids[k]))
	}
	return ids
}

// commandStates counts nodeID's commands by state.
func commandStates(t *testing.T, db *pgtest.DB, nodeID string) map[string]int {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), `SELECT state, count(*)::int FROM commands WHERE node_id = $1 GROUP BY state`, nodeID)
	require.NoError(t, err)
	out := map[string]int{}
	for rows.Next() {
		var (
			s string
			n int
		)
		require.NoError(t, rows.Scan(&s, &n))
		out[s] = n
	}
	require.NoError(t, rows.Err())
	return out
}

// awaitWindowFull waits until a dispatch round has found a full window more
// than before times: the observed signal that dispatch looked and held back.
func awaitWindowFull(t *testing.T, g *Gateway, before float64) float64 {
	t.Helper()
	require.Eventually(t, func() bool { return testutil.ToFloat64(g.m.windowFull) > before },
		10*time.Second, 5*time.Millisecond, "dispatch never found the window full")
	return testutil.ToFloat64(g.m.windowFull)
}

func sendResult(t *testing.T, s *rawSession, commandID string) {
	t.Helper()
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandResult{CommandResult: &nodev1.CommandResult{
		CommandId: commandID, ResultId: commandID + "/1",
	}}}))
}

func recvCommand(t *testing.T, s *rawSession) string {
	t.Helper()
	m, err := s.recv(t, 10*time.Second)
	require.NoError(t, err)
	require.NotNil(t, m.GetCommand(), "want a Command, got %v", m)
	return m.GetCommand().GetCommandId()
}

// TestNodeWindowHoldsTheRestPending: a node with a window of 3 and 7
// pending commands gets the oldest 3; the other 4 stay pending in the
// database (not queued in the gateway) until results free room, and each
// result brings the next command, in order, without waiting for the poll.
func TestNodeWindowHoldsTheRestPending(t *testing.T) {
	t.Parallel()
	c := newWindowCase(t, 3, 7)
	g, db, want := c.g, c.db, c.ids
	s := c.connect(t)
	got := []string{recvCommand(t, s), recvCommand(t, s), recvCommand(t, s)}
	require.Equal(t, want[:3], got)
	full := awaitWindowFull(t, g, 0)
	require.Equal(t, map[string]int{"dispatched": 3, "pending": 4}, commandStates(t, db, "n-0"))

	for k := range want {
		sendResult(t, s, want[k])
		if k+3 < len(want) {
			require.Equal(t, want[k+3], recvCommand(t, s), "result %d brings the next command", k)
		}
	}
	require.Eventually(t, func() bool {
		return fmt.Sprint(commandStates(t, db, "n-0")) == fmt.Sprint(map[string]int{"succeeded": 7})
	}, 10*time.Second, 10*time.Millisecond)
	require.GreaterOrEqual(t, testutil.ToFloat64(g.m.windowFull), full)
	require.EqualValues(t, 7, testutil.ToFloat64(g.m.dispatched), "each command dispatched once")
}

// TestReplayCountsIntoTheWindow: commands replayed on Hello are sent even
// past the window (the node may be running them) and count into it, so a
// pending command waits until the node is back under its window.
func TestReplayCountsIntoTheWindow(t *testing.T) {
	t.Parallel()
	c := newWindowCase(t, 2, 4)
	g, db, ids := c.g, c.db, c.ids
	_, err := db.Pool.Exec(context.Background(),
		`UPDATE commands SET state = 'dispatched', dispatched_at = compute_now(), dispatch_count = 1 WHERE id = ANY($1)`, ids[:3])
	require.NoError(t, err)

	s := c.connect(t)
	replayed := map[string]bool{}
	for range 3 {
		replayed[recvCommand(t, s)] = true
	}
	require.Equal(t, map[string]bool{ids[0]: true, ids[1]: true, ids[2]: true}, replayed)
	full := awaitWindowFull(t, g, 0) // the Hello's dispatch held the pending one back

	// 2 unanswered of a window of 2: still full.
	sendResult(t, s, ids[0])
	awaitWindowFull(t, g, full)
	require.Equal(t, 1, commandStates(t, db, "n-0")["pending"], "the fourth command waits while the window is full")

	sendResult(t, s, ids[1])
	require.Equal(t, ids[3], recvCommand(t, s), "back under the window, the pending command comes")
	require.EqualValues(t, 3, testutil.ToFloat64(g.m.replayed))
}

// TestNodeWindowIsValidated: the window is at least 1 and at most half the
// session queue, and the error names the flag.
func TestNodeWindowIsValidated(t *testing.T) {
	for _, w := range []int{0, -1, maxQueued/2 + 1} {
		cfg := testConfig()
		cfg.NodeWindow = w
		err := cfg.Validate()
		require.ErrorContains(t, err, "--gateway.node-window", "window %d", w)
	}
	cfg := testConfig()
	cfg.NodeWindow = maxQueued / 2
	require.NoError(t, cfg.Validate())
}

// TestCancelReachesANodeWithAFullWindow: a cancel of a command of a node
// whose window is full is still sent, though dispatch asks no database for
// that node's commands (the cancel is what lets a node stop a command and
// free its slot); the node's CancelAck brings the next command.
func TestCancelReachesANodeWithAFullWindow(t *testing.T) {
	t.Parallel()
	c := newWindowCase(t, 1, 2)
	g, db, want := c.g, c.db, c.ids
	s := c.connect(t)
	require.Equal(t, want[0], recvCommand(t, s))
	awaitWindowFull(t, g, 0)

	cancelInDB(t, db, want[0])
	g.wakeDispatch("n-0") // what the api's CancelCommand does through NOTIFY
	require.Equal(t, want[0], nextCancel(t, s))
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CancelAck{CancelAck: &nodev1.CancelAck{
		CommandId: want[0], Outcome: nodev1.CancelOutcome_CANCEL_OUTCOME_STOPPED}}}))
	require.Equal(t, want[1], recvCommand(t, s), "the acknowledged cancel frees the slot")
}
