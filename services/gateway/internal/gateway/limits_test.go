package gateway

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgtest"
)

// requirePushback reads the answer to a Hello on s and requires a Pushback
// for reason, then the stream's end with code.
func requirePushback(t *testing.T, s *rawSession, reason string, code connect.Code) {
	t.Helper()
	m, err := s.recv(t, 10*time.Second)
	require.NoError(t, err)
	require.Equal(t, reason, m.GetPushback().GetReason(), "want a %s pushback, got %v", reason, m)
	require.Positive(t, m.GetPushback().GetRetryAfter().AsDuration())
	require.Equal(t, code, s.recvUntilErr(t, 10*time.Second))
}

// TestStreamLimitPushesBack: with --gateway.max-streams 2, a third stream
// is pushed back RESOURCE_EXHAUSTED (reason max-streams, counted) before
// any database work, the two sessions are untouched, and once one of them
// ends a new dial is welcomed.
func TestStreamLimitPushesBack(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	cfg.MaxStreams, cfg.MaxPendingHellos, cfg.MaxPendingAuths = 2, 2, 2
	db := pgtest.NewDB(t)
	g := startGateway(t, db, cfg)
	creds := registerNodes(t, db, "s", 3)
	a, b := dialRaw(t, g.Addr()), dialRaw(t, g.Addr())
	a.welcome(t, "s-0", creds[0])
	b.welcome(t, "s-1", creds[1])

	c := dialRaw(t, g.Addr())
	require.NoError(t, c.hello("s-2", creds[2]))
	requirePushback(t, c, "max-streams", connect.CodeResourceExhausted)
	require.InDelta(t, 1, testutil.ToFloat64(g.m.pushbacks.WithLabelValues("max-streams")), 0)
	require.Equal(t, 2, g.SessionCount(), "the sessions in place are untouched")

	// End a's stream from the node's side (Go's HTTP/2 client sends
	// nothing on a cancel while its request body is open: close that too).
	a.cancel()
	_ = a.stream.CloseRequest()
	require.Eventually(t, func() bool { return g.streams.Load() == 1 }, 30*time.Second, 5*time.Millisecond, "the ended stream frees its slot")
	dialRaw(t, g.Addr()).welcome(t, "s-2", creds[2])
}

// TestHelloCapPushesBack: with --gateway.max-pending-hellos 1, while one
// Hello's transaction waits (its node row is locked), another node's Hello
// is pushed back RESOURCE_EXHAUSTED (reason max-pending-hellos, counted)
// instead of queueing a second transaction; both are welcomed once the
// first one's transaction can finish.
func TestHelloCapPushesBack(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	cfg.MaxPendingHellos, cfg.MaxPendingAuths = 1, 1
	db := pgtest.NewDB(t)
	g := startGateway(t, db, cfg)
	creds := registerNodes(t, db, "p", 2)

	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM nodes WHERE id = 'p-0' FOR UPDATE`)
	require.NoError(t, err)

	first := dialRaw(t, g.Addr())
	require.NoError(t, first.hello("p-0", creds[0]))
	require.Eventually(t, func() bool { return g.pending.Load() == 1 }, 10*time.Second, 5*time.Millisecond, "the first Hello holds the one slot")
	require.Eventually(t, func() bool {
		var waiting int
		err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting)
		return err == nil && waiting > 0
	}, 10*time.Second, 5*time.Millisecond, "the first Hello's transaction waits on the locked node")

	second := dialRaw(t, g.Addr())
	require.NoError(t, second.hello("p-1", creds[1]))
	requirePushback(t, second, "max-pending-hellos", connect.CodeResourceExhausted)
	require.InDelta(t, 1, testutil.ToFloat64(g.m.pushbacks.WithLabelValues("max-pending-hellos")), 0)

	require.NoError(t, tx.Rollback(ctx))
	m, err := first.recv(t, 10*time.Second)
	require.NoError(t, err)
	require.NotNil(t, m.GetWelcome(), "the waiting Hello is welcomed once it can finish: %v", m)
	dialRaw(t, g.Addr()).welcome(t, "p-1", creds[1])
	require.Zero(t, g.pending.Load(), "every slot is free again")
}
