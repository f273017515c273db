package nodestate

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type fixture struct {
	db  *pgxpool.Pool
	cfg Config
}

func setup(t *testing.T) fixture {
	t.Helper()
	db := pgtest.New(t)
	return fixture{db: db, cfg: DefaultConfig()}
}

func (f fixture) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	_, err := f.db.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
}

// node creates a connected node at epoch with its session on gateway gw,
// whose lease is live when gwLive.
func (f fixture) node(t *testing.T, id, gw string, epoch int64, gwLive bool) {
	t.Helper()
	f.exec(t, "INSERT INTO nodes (id, state, state_epoch) VALUES ($1, 'connected', $2)", id, epoch)
	f.exec(t, `INSERT INTO node_sessions (node_id, gateway_id, session_epoch, state, session_expires_at)
		VALUES ($1, $2, $3, 'connected', compute_now() + interval '40 seconds')`, id, gw, epoch)
	expires := "compute_now() + interval '20 seconds'"
	if !gwLive {
		expires = "compute_now() - interval '1 second'"
	}
	f.exec(t, `INSERT INTO leases (name, owner, epoch, expires_at) VALUES ('gateway:' || $1::text, $1::text, 1, `+expires+`)
		ON CONFLICT (name) DO NOTHING`, gw)
}

func (f fixture) reconcile(t *testing.T, id string) {
	t.Helper()
	require.NoError(t, pgdb.InTx(context.Background(), f.db, func(tx pgx.Tx) error {
		return Reconcile(context.Background(), tx, id, f.cfg)
	}))
}

func (f fixture) state(t *testing.T, id string) (node, session string, reason *string) {
	t.Helper()
	require.NoError(t, f.db.QueryRow(context.Background(), `
SELECT n.state, s.state, s.close_reason FROM nodes n JOIN node_sessions s ON s.node_id = n.id WHERE n.id = $1`, id).Scan(&node, &session, &reason))
	return
}

func (f fixture) events(t *testing.T, id string) []string {
	t.Helper()
	rows, err := f.db.Query(context.Background(), "SELECT kind FROM node_events WHERE node_id = $1 ORDER BY seq", id)
	require.NoError(t, err)
	kinds, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return kinds
}

func TestLiveGatewayKeepsNodeConnected(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.node(t, "n1", "gw_a", 3, true)
	f.reconcile(t, "n1")
	n, s, _ := f.state(t, "n1")
	require.Equal(t, "connected", n)
	require.Equal(t, "connected", s)
	require.Empty(t, f.events(t, "n1"))
}

func TestLostGatewayDisconnectsThenUnreachableAfterGrace(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.node(t, "n1", "gw_dead", 3, false)
	f.reconcile(t, "n1")
	n, s, reason := f.state(t, "n1")
	require.Equal(t, "disconnected", n)
	require.Equal(t, "disconnected", s)
	require.Equal(t, "gateway_lost", *reason)
	require.Equal(t, []string{"node.disconnected"}, f.events(t, "n1"))

	// The 40 s session lease ran out, but the 120 s gateway-loss grace has not.
	f.exec(t, "UPDATE node_sessions SET session_expires_at = compute_now() - interval '60 seconds' WHERE node_id = 'n1'")
	f.reconcile(t, "n1")
	n, _, _ = f.state(t, "n1")
	require.Equal(t, "disconnected", n, "still within the gateway-loss grace")

	f.exec(t, "UPDATE node_sessions SET session_expires_at = compute_now() - interval '121 seconds' WHERE node_id = 'n1'")
	f.reconcile(t, "n1")
	n, _, _ = f.state(t, "n1")
	require.Equal(t, "unreachable", n)
	require.Equal(t, []string{"node.disconnected", "node.unreachable"}, f.events(t, "n1"))

	// Idempotent: running again records nothing new.
	f.reconcile(t, "n1")
	require.Len(t, f.events(t, "n1"), 2)
}

func TestClosedStreamGetsNoGrace(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.node(t, "n1", "gw_a", 2, true)
	// The gateway closed the stream and marked both (its own close path).
	f.exec(t, "UPDATE node_sessions SET state = 'disconnected', closed_at = compute_now(), session_expires_at = compute_now() - interval '1 second' WHERE node_id = 'n1'")
	f.exec(t, "UPDATE nodes SET state = 'disconnected' WHERE id = 'n1'")
	f.reconcile(t, "n1")
	n, _, _ := f.state(t, "n1")
	require.Equal(t, "unreachable", n, "no gateway-loss grace after a clean close")
}

func TestTransitionAtAStaleEpochChangesNothing(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.node(t, "n1", "gw_dead", 5, false)
	var o observed
	ctx := context.Background()
	require.NoError(t, f.db.QueryRow(ctx, readSQL, "n1").Scan(&o.nodeState, &o.epoch, &o.sessionState, &o.gatewayID,
		&o.expiresAt, &o.closeReason, &o.gatewayLive, &o.now))
	// A Hello on another gateway lands between the read and the write.
	f.exec(t, "UPDATE node_sessions SET session_epoch = 6, gateway_id = 'gw_b', session_expires_at = compute_now() + interval '40 seconds' WHERE node_id = 'n1'")
	f.exec(t, "UPDATE nodes SET state_epoch = 6 WHERE id = 'n1'")
	require.NoError(t, pgdb.InTx(ctx, f.db, func(tx pgx.Tx) error { return disconnect(ctx, tx, "n1", o, "gateway_lost") }))
	n, s, _ := f.state(t, "n1")
	require.Equal(t, "connected", n, "the Hello wins")
	require.Equal(t, "connected", s)
	require.Empty(t, f.events(t, "n1"))

	o.sessionState, o.nodeState = "disconnected", "disconnected"
	require.NoError(t, pgdb.InTx(ctx, f.db, func(tx pgx.Tx) error { return markUnreachable(ctx, tx, "n1", o, 0) }))
	n, _, _ = f.state(t, "n1")
	require.Equal(t, "connected", n)
}

func TestTransitionsNeverReleaseAllocations(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.node(t, "n1", "gw_dead", 1, false)
	f.exec(t, "INSERT INTO pools (id) VALUES ('p1')")
	f.exec(t, "INSERT INTO pool_leases (id, pool_id, tenant, count, state) VALUES ('pl1', 'p1', 't', 1, 'allocated')")
	f.exec(t, "INSERT INTO node_allocations (node_id, pool_lease_id, pool_id, placer_epoch, placed_by) VALUES ('n1', 'pl1', 'p1', 1, 'x')")
	f.reconcile(t, "n1")
	f.exec(t, "UPDATE node_sessions SET session_expires_at = compute_now() - interval '1 hour' WHERE node_id = 'n1'")
	f.reconcile(t, "n1")
	n, _, _ := f.state(t, "n1")
	require.Equal(t, "unreachable", n)
	var allocs int
	require.NoError(t, f.db.QueryRow(context.Background(), "SELECT count(*) FROM node_allocations WHERE node_id = 'n1'").Scan(&allocs))
	require.Equal(t, 1, allocs)
}

func TestScanEnqueuesOnlyDueNodes(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.node(t, "live", "gw_a", 1, true)
	f.node(t, "lost", "gw_dead", 1, false)
	f.node(t, "closed", "gw_a", 1, true)
	f.exec(t, "UPDATE node_sessions SET state = 'disconnected' WHERE node_id = 'closed'") // node still says connected
	f.node(t, "graced", "gw_a", 1, true)
	f.exec(t, "UPDATE node_sessions SET state = 'disconnected', close_reason = 'gateway_lost', session_expires_at = compute_now() - interval '30 seconds' WHERE node_id = 'graced'")
	f.exec(t, "UPDATE nodes SET state = 'disconnected' WHERE id = 'graced'")
	var n int
	require.NoError(t, pgdb.InTx(context.Background(), f.db, func(tx pgx.Tx) error {
		var err error
		n, err = Scan(context.Background(), tx, f.cfg)
		return err
	}))
	require.Equal(t, 2, n)
	rows, err := f.db.Query(context.Background(), "SELECT key FROM work_queue WHERE reconciler = 'nodes' ORDER BY key")
	require.NoError(t, err)
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"closed", "lost"}, keys)
}
