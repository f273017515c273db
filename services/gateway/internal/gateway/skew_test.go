package gateway

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// TestNodeClockSkewReachesTheDatabase: a node whose clock runs 5 s ahead
// says so in its heartbeats' sent_at; the gateway's liveness write records
// about +5000 ms in node_sessions.clock_skew_ms (what leasehold-doctor
// reads), exports the largest skew among its sessions, and its own skew
// against the database (this machine's clock: near 0). A heartbeat without
// sent_at leaves the last measurement in place.
func TestNodeClockSkewReachesTheDatabase(t *testing.T) {
	t.Parallel()
	db, g, s := oneNodeSession(t, testConfig())
	ctx := context.Background()
	skew := func() (ms *int32) {
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT clock_skew_ms FROM node_sessions WHERE node_id = 'n-0'`).Scan(&ms))
		return ms
	}
	require.Nil(t, skew(), "nothing is measured before a heartbeat")

	heartbeat := func(seq uint64, sentAt *timestamppb.Timestamp) {
		require.NoError(t, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Heartbeat{Heartbeat: &nodev1.Heartbeat{Sequence: seq, SentAt: sentAt}}}))
		for {
			m, err := s.recv(t, 10*time.Second)
			require.NoError(t, err)
			if m.GetHeartbeatAck().GetSequence() == seq {
				return
			}
		}
	}
	heartbeat(1, timestamppb.New(time.Now().Add(5*time.Second)))
	var got int32
	require.Eventually(t, func() bool {
		ms := skew()
		if ms == nil {
			return false
		}
		got = *ms
		return true
	}, 10*time.Second, 20*time.Millisecond, "the liveness write records the skew")
	require.InDelta(t, 5000, got, 1000, "about +5 s (a loaded machine's delivery and the gateway's own skew aside)")
	require.InDelta(t, 5, testutil.ToFloat64(g.m.nodeSkewMax), 1)
	require.InDelta(t, 0, testutil.ToFloat64(g.m.clockSkew), 1, "the gateway shares this machine's clock with the database")

	heartbeat(2, nil)
	lastSeen := func() (at time.Time) {
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT last_seen_at FROM node_sessions WHERE node_id = 'n-0'`).Scan(&at))
		return at
	}
	before := lastSeen()
	require.Eventually(t, func() bool { return lastSeen().After(before) }, 10*time.Second, 20*time.Millisecond, "a liveness write after the heartbeat")
	require.NotNil(t, skew())
	require.InDelta(t, 5000, *skew(), 1000, "a heartbeat without sent_at keeps the last measurement")
}
