package api

import (
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
)

// TestCreateCommandRefusedWhileItsGatewayIsOverloaded: a gateway that
// reports overload in gateway_load (and holds its lease) gets no new
// command for its nodes (RESOURCE_EXHAUSTED naming the gateway and its lag,
// nothing written); a repeat of an idempotent create still gets its
// command; nodes of another gateway, and nodes with no session, are
// admitted; a row of a gateway whose lease lapsed, or one written under an
// earlier epoch of its lease, is ignored; and once the gateway reports it is
// no longer overloaded, its nodes are admitted again.
func TestCreateCommandRefusedWhileItsGatewayIsOverloaded(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *Config, _ *http.Transport) { c.OverloadAdmission = true })
	ctx := ctxT(t)
	for _, n := range []string{"node-1", "node-2", "node-3", "node-4", "node-5"} {
		b.registerNode(n, nil)
	}
	b.exec(`INSERT INTO leases (name, owner, epoch, expires_at) VALUES
  ('gateway:gw-1', 'gw-1', 3, compute_now() + interval '1 hour'),
  ('gateway:gw-2', 'gw-2', 1, compute_now() + interval '1 hour'),
  ('gateway:gw-3', 'gw-3', 1, compute_now() - interval '1 second'),
  ('gateway:gw-4', 'gw-4', 5, compute_now() + interval '1 hour')`)
	b.exec(`INSERT INTO node_sessions (node_id, gateway_id, state, session_expires_at) VALUES
  ('node-1', 'gw-1', 'connected', compute_now() + interval '1 hour'),
  ('node-2', 'gw-2', 'connected', compute_now() + interval '1 hour'),
  ('node-3', 'gw-3', 'connected', compute_now() + interval '1 hour'),
  ('node-5', 'gw-4', 'connected', compute_now() + interval '1 hour')`)
	b.exec(`INSERT INTO gateway_load (gateway_id, lease_epoch, lag_ms, overloaded) VALUES
  ('gw-1', 3, 2500, true), ('gw-2', 1, 40, false), ('gw-3', 1, 9000, true), ('gw-4', 4, 9000, true)`)
	w := b.svc.handler.overload
	require.NotNil(t, w)
	w.read(ctx)
	require.Equal(t, 1.0, testutil.ToFloat64(w.gauge), "gw-3's lease lapsed and gw-4's row is of an earlier epoch: both ignored")

	create := func(node, key string) (*connect.Response[controlv1.CreateCommandResponse], error) {
		return b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{
			NodeId: node, Kind: "exec", Payload: []byte(`{"argv":["true"]}`), IdempotencyKey: key}))
	}
	b.exec(`INSERT INTO commands (node_id, kind, idempotency_key) VALUES ('node-1', 'exec', 'before')`)
	before := b.count(`SELECT count(*) FROM commands`)
	_, err := create("node-1", "k-1")
	ce := requireConnectError(t, err, connect.CodeResourceExhausted)
	require.Contains(t, ce.Message(), `node "node-1" is served by gateway "gw-1", which is overloaded`)
	require.Contains(t, ce.Message(), "2.5s")
	require.Equal(t, "3", ce.Meta().Get("Retry-After"), "the gateway's wait, rounded up to whole seconds")
	_, err = b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{
		NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
	requireCode(t, err, connect.CodeResourceExhausted, "without a key: refused before the transaction")
	require.Equal(t, before, b.count(`SELECT count(*) FROM commands`), "the refused commands are not written")
	require.Equal(t, 2.0, testutil.ToFloat64(w.refused))

	b.exec(`UPDATE commands SET payload = '{"argv":["true"]}' WHERE idempotency_key = 'before'`)
	again, err := create("node-1", "before")
	require.NoError(t, err, "a repeat of an idempotent create gets its command while the gateway is overloaded")
	require.False(t, again.Msg.GetCreated())

	for _, n := range []string{"node-2", "node-3", "node-4", "node-5"} {
		r, err := create(n, "k-1")
		require.NoError(t, err, "%s: its gateway is not overloaded, its lease lapsed, it has no session, or the row predates the lease's epoch", n)
		require.True(t, r.Msg.GetCreated())
	}

	b.exec(`UPDATE gateway_load SET overloaded = false, lag_ms = 300 WHERE gateway_id = 'gw-1'`)
	w.read(ctx)
	require.Equal(t, 0.0, testutil.ToFloat64(w.gauge))
	r, err := create("node-1", "k-1")
	require.NoError(t, err, "admitted again once the gateway is no longer overloaded")
	require.True(t, r.Msg.GetCreated())
}

// TestOverloadAdmissionOff: with --api.overload-admission=false nothing is
// read and nothing refused.
func TestOverloadAdmissionOff(t *testing.T) {
	t.Parallel()
	b := setup(t)
	require.Nil(t, b.svc.handler.overload)
	ctx := ctxT(t)
	b.registerNode("node-1", nil)
	b.exec(`INSERT INTO leases (name, owner, epoch, expires_at) VALUES ('gateway:gw-1', 'gw-1', 3, compute_now() + interval '1 hour')`)
	b.exec(`INSERT INTO node_sessions (node_id, gateway_id, state, session_expires_at) VALUES ('node-1', 'gw-1', 'connected', compute_now() + interval '1 hour')`)
	b.exec(`INSERT INTO gateway_load (gateway_id, lease_epoch, lag_ms, overloaded) VALUES ('gw-1', 3, 2500, true)`)
	_, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{
		NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
	require.NoError(t, err)
}

// TestOverloadRetryAfterIsTheLagInWholeSeconds: an overload refusal asks
// the client to come back after the gateway's wait, one to ten seconds.
func TestOverloadRetryAfterIsTheLagInWholeSeconds(t *testing.T) {
	for lag, want := range map[time.Duration]int{0: 1, 300 * time.Millisecond: 1, time.Second: 1, 1001 * time.Millisecond: 2, 2500 * time.Millisecond: 3, time.Minute: 10} {
		require.Equal(t, want, overloadRetryAfter(lag), "lag %s", lag)
	}
}
