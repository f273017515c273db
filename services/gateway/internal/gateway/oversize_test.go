package gateway

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestOversizedCommandFailsSessionLives: a command whose message exceeds
// --gateway.max-message-bytes ends failed with a reason naming the limit,
// and the small command queued behind it runs on the same session.
func TestOversizedCommandFailsSessionLives(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	cfg := testConfig()
	cfg.MaxMessageBytes = 64 << 10
	g := startGateway(t, db, cfg)
	creds := registerNodes(t, db, "n", 1)
	ctx := context.Background()
	var big, small string
	require.NoError(t, db.Pool.QueryRow(ctx, `INSERT INTO commands (node_id, kind, payload) VALUES ('n-0', 'exec', $1) RETURNING id`,
		randomBytes(t, cfg.MaxMessageBytes-10)).Scan(&big))
	require.NoError(t, db.Pool.QueryRow(ctx, `INSERT INTO commands (node_id, kind, payload, created_at) VALUES ('n-0', 'exec', 'x', compute_now() + interval '1 ms') RETURNING id`).Scan(&small))

	s := dialRaw(t, g.Addr())
	s.welcome(t, "n-0", creds[0])
	m, err := s.recv(t, 10*time.Second)
	require.NoError(t, err)
	require.Equal(t, small, m.GetCommand().GetCommandId())
	require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandResult{CommandResult: &nodev1.CommandResult{
		CommandId: small, ResultId: small + "/1"}}}))
	s.sync(t, 1)
	// The result goes through the group commit, which a loaded machine
	// may not have flushed by the time the heartbeat is acknowledged; so
	// does the oversized command's failure, written after its dispatch.
	require.Eventually(t, func() bool { return commandState(t, db, small) == "succeeded" }, 30*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool { return commandState(t, db, big) == "failed" }, 30*time.Second, 20*time.Millisecond)
	var reason string
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT error FROM command_results_all WHERE command_id = $1`, big).Scan(&reason))
	require.Contains(t, reason, fmt.Sprintf("does not fit the gateway's --gateway.max-message-bytes %d", cfg.MaxMessageBytes))
	require.Equal(t, int64(1), sessionEpoch(t, db, "n-0"), "one session throughout")
}

// TestOversizedReplayFailsSessionLives: a too-large command already
// dispatched (by a gateway with a larger limit) is failed in the Hello
// instead of replayed, and the session is welcomed and stays.
func TestOversizedReplayFailsSessionLives(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	cfg := testConfig()
	cfg.MaxMessageBytes = 64 << 10
	g := startGateway(t, db, cfg)
	creds := registerNodes(t, db, "n", 1)
	ctx := context.Background()
	var big string
	require.NoError(t, db.Pool.QueryRow(ctx, `INSERT INTO commands (node_id, kind, payload, state, dispatch_count) VALUES ('n-0', 'exec', $1, 'dispatched', 1) RETURNING id`,
		randomBytes(t, cfg.MaxMessageBytes)).Scan(&big))
	s := dialRaw(t, g.Addr())
	s.welcome(t, "n-0", creds[0])
	s.sync(t, 1)
	require.Equal(t, "failed", commandState(t, db, big))
	small := dispatchedTo(t, db, s, "n-0")
	require.NotEmpty(t, small)
	require.Equal(t, int64(1), sessionEpoch(t, db, "n-0"))
}
