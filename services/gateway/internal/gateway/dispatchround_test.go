package gateway

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgnotify"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestDispatchRoundAsksAtMostTheBatch: one dispatch call asks at most
// batch sessions, each for a share that can fill the batch, and leaves the
// others, every one of them, to the following rounds.
func TestDispatchRoundAsksAtMostTheBatch(t *testing.T) {
	sessions := func(n int) []*session {
		out := make([]*session, n)
		for i := range out {
			out[i] = &session{nodeID: fmt.Sprint("n-", i)}
		}
		return out
	}
	for _, c := range []struct {
		sessions, batch, round, later, share int
	}{
		{300, 500, 300, 0, 2},
		{300, 100, 100, 200, 1},
		{5000, 100, 100, 4900, 1},
		{1, 100, 1, 0, 100},
		{7, 3, 3, 4, 1},
	} {
		all := sessions(c.sessions)
		round, later, share := nextRound(all, c.batch)
		require.Len(t, round, c.round, "%+v", c)
		require.Len(t, later, c.later, "%+v", c)
		require.Equal(t, c.share, share, "%+v", c)
		seen := map[string]bool{}
		for _, s := range append(append([]*session{}, round...), later...) {
			require.False(t, seen[s.nodeID], "asked once")
			seen[s.nodeID] = true
		}
		require.Len(t, seen, c.sessions, "every session asked now or later")
		require.Len(t, all, c.sessions, "the caller's slice is not overwritten")
		for i, s := range all {
			require.Equal(t, fmt.Sprint("n-", i), s.nodeID)
		}
	}
}

// TestSplitLanesDealsSessionsOnce: a wake-up whose sessions fill more than
// one call is dealt into at most dispatchLanes lanes, each session in
// exactly one, and one batch or less stays in one lane.
func TestSplitLanesDealsSessionsOnce(t *testing.T) {
	for _, c := range []struct{ sessions, batch, lanes int }{
		{0, 100, 1}, {1, 100, 1}, {100, 100, 1}, {101, 100, 2}, {300, 100, 2}, {12, 5, 2}, {5000, 100, 2},
	} {
		all := make([]*session, c.sessions)
		for i := range all {
			all[i] = &session{nodeID: fmt.Sprint("n-", i)}
		}
		lanes := splitLanes(all, c.batch, dispatchLanes)
		require.Len(t, lanes, c.lanes, "%+v", c)
		seen := map[string]bool{}
		for _, lane := range lanes {
			require.LessOrEqual(t, len(lane), (c.sessions+len(lanes)-1)/len(lanes), "lanes are even: %+v", c)
			for _, s := range lane {
				require.False(t, seen[s.nodeID], "a session in one lane")
				seen[s.nodeID] = true
			}
		}
		require.Len(t, seen, c.sessions, "every session in a lane")
	}
}

// TestSmallBatchStillReachesEverySession: with more sessions than the batch
// (12 sessions, batch 5), a wake-up (the NOTIFY, or the poll where
// notifications are off) still reaches every node's pending commands,
// round after round, each node's in creation order.
func TestSmallBatchStillReachesEverySession(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	cfg := testConfig()
	cfg.DispatchBatch = 5
	g := startGateway(t, db, cfg)
	const nodes, each = 12, 3
	creds := registerNodes(t, db, "n", nodes)
	sessions := make([]*rawSession, nodes)
	for i := range sessions {
		sessions[i] = dialRaw(t, g.Addr())
		sessions[i].welcome(t, fmt.Sprint("n-", i), creds[i])
	}
	want := make([][]string, nodes)
	// One transaction, one wake-up for every session.
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	for k := range each {
		for i := range nodes {
			var id string
			require.NoError(t, tx.QueryRow(ctx, `INSERT INTO commands (node_id, kind, created_at) VALUES ($1, 'exec', compute_now() + make_interval(secs => $2)) RETURNING id`,
				fmt.Sprint("n-", i), k).Scan(&id))
			want[i] = append(want[i], id)
		}
	}
	_, err = tx.Exec(ctx, `SELECT pg_notify($1, '')`, pgnotify.Commands)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	for i, s := range sessions {
		var got []string
		for range each {
			m, err := s.recv(t, 10*time.Second)
			require.NoError(t, err, "node %d", i)
			got = append(got, m.GetCommand().GetCommandId())
		}
		require.Equal(t, want[i], got, "node %d gets its commands in order", i)
	}
}
