package gateway

import (
	"context"
	"errors"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// lockCommand holds commandID's row FOR UPDATE in a transaction of its own
// until the returned release is called, so a group commit storing a result
// for it waits on the lock.
func lockCommand(t *testing.T, db *pgtest.DB, commandID string) (release func()) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	var id string
	require.NoError(t, tx.QueryRow(ctx, `SELECT id FROM commands WHERE id = $1 FOR UPDATE`, commandID).Scan(&id))
	done := false
	release = func() {
		if !done {
			done = true
			require.NoError(t, tx.Rollback(ctx))
		}
	}
	t.Cleanup(release)
	return release
}

// awaitBlockedIngest waits until a statement of the gateway's pool waits
// on a row lock (the group commit stuck behind lockCommand) and returns
// its backend pid. The statement is matched by its start: pg_stat_activity
// keeps only the first kilobyte of a query's text.
func awaitBlockedIngest(t *testing.T, db *pgtest.DB) int {
	t.Helper()
	var pid int
	require.Eventually(t, func() bool {
		err := db.Pool.QueryRow(context.Background(), `
SELECT pid FROM pg_stat_activity
 WHERE datname = current_database() AND wait_event_type = 'Lock' AND strpos(query, 'WITH r AS (') > 0
 LIMIT 1`).Scan(&pid)
		if errors.Is(err, pgx.ErrNoRows) {
			return false
		}
		require.NoError(t, err)
		return true
	}, 10*time.Second, 5*time.Millisecond, "the group commit never waited on the locked command")
	return pid
}

// TestResultsAreReadWhileTheyCommit: the read loop does not wait for a
// result's commit. With the first result's group commit stuck on a row
// lock, the node's second result is still read (it frees a slot of the
// node window of 2, so the fourth command is dispatched); a Heartbeat is
// answered only once both results are stored.
func TestResultsAreReadWhileTheyCommit(t *testing.T) {
	t.Parallel()
	c := newWindowCase(t, 2, 4)
	db, ids := c.db, c.ids
	s := c.connect(t)
	require.Equal(t, ids[:2], []string{recvCommand(t, s), recvCommand(t, s)})

	release := lockCommand(t, db, ids[0])
	sendResult(t, s, ids[0])
	awaitBlockedIngest(t, db)
	require.Equal(t, ids[2], recvCommand(t, s), "the first result frees a slot")
	sendResult(t, s, ids[1])
	require.Equal(t, ids[3], recvCommand(t, s), "the second result was read while the first one's commit waits")

	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Heartbeat{Heartbeat: &nodev1.Heartbeat{Sequence: 9}}}))
	require.Zero(t, commandStates(t, db, "n-0")["succeeded"], "nothing is stored while the first commit waits")
	release()
	m, err := s.recv(t, 10*time.Second)
	require.NoError(t, err)
	require.EqualValues(t, 9, m.GetHeartbeatAck().GetSequence(), "want the HeartbeatAck, got %v", m)
	require.Equal(t, map[string]int{"succeeded": 2, "dispatched": 2}, commandStates(t, db, "n-0"),
		"a HeartbeatAck comes after every earlier result is stored")
}

// TestFailedResultWriteClosesSession: a result whose group commit fails
// (here its connection is terminated while it waits on a lock) closes the
// session UNAVAILABLE though the read loop did not wait for it, and the
// command, still in flight, is replayed on the next Hello so the node can
// resend its result.
func TestFailedResultWriteClosesSession(t *testing.T) {
	t.Parallel()
	c := newWindowCase(t, 4, 1)
	db, ids := c.db, c.ids
	s := c.connect(t)
	require.Equal(t, ids[0], recvCommand(t, s))

	release := lockCommand(t, db, ids[0])
	sendResult(t, s, ids[0])
	pid := awaitBlockedIngest(t, db)
	var killed bool
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT pg_terminate_backend($1)`, pid).Scan(&killed))
	require.True(t, killed)
	require.Equal(t, connect.CodeUnavailable, s.recvUntilErr(t, 10*time.Second))
	release()

	s2 := c.connect(t)
	require.Equal(t, ids[0], recvCommand(t, s2), "the command is replayed")
	sendResult(t, s2, ids[0])
	require.Eventually(t, func() bool { return commandStates(t, db, "n-0")["succeeded"] == 1 }, 10*time.Second, 10*time.Millisecond)
}
