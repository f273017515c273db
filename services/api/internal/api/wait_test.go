package api

import (
	"context"
	"log/slog"
	"net/url"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/faultproxy"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
)

// TestWaiterRidesThroughAnOutage: the waiter's LISTEN session goes through
// a proxy that cuts it and refuses new connections (the database is gone).
// The waiter stops listening, keeps trying, and once the database answers
// again it listens again with no restart: a notification sent after the
// outage wakes a WaitCommand, with a poll interval of an hour.
func TestWaiterRidesThroughAnOutage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	if b.db.DirectURL == "" {
		t.Skip("no direct connection to LISTEN on")
	}
	ctx := ctxT(t)
	u, err := url.Parse(b.db.DirectURL)
	require.NoError(t, err)
	proxy, err := faultproxy.New(u.Host)
	require.NoError(t, err)
	defer proxy.Close()
	via := *u
	via.Host = proxy.Addr()

	b.registerNode("node-1", nil)
	r, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
	require.NoError(t, err)
	id := r.Msg.GetCommand().GetId()

	w := newWaiter(b.db.Pool, via.String(), time.Hour, slog.New(slog.DiscardHandler))
	wctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); w.run(wctx) }()
	defer func() { stop(); <-done }()
	require.Eventually(t, w.listening.Load, 10*time.Second, 5*time.Millisecond)

	proxy.Refuse()
	proxy.CutAll()
	require.Eventually(t, func() bool { return !w.listening.Load() }, 10*time.Second, 5*time.Millisecond, "the lost session is noticed")
	// Down for a few reconnect attempts (one a second), each seen refused.
	require.Eventually(t, func() bool { return proxy.Refused() >= 2 }, 15*time.Second, 5*time.Millisecond, "the waiter keeps trying")
	require.False(t, w.listening.Load(), "no session while the database refuses")

	proxy.Restore()
	require.Eventually(t, w.listening.Load, 15*time.Second, 5*time.Millisecond, "listening again after the outage")
	finished, unregister := w.register(id)
	defer unregister()
	_, err = b.db.Pool.Exec(ctx, `
WITH r AS (INSERT INTO command_results (node_id, id, command_id, exit_code, output, gateway_id, session_epoch)
           VALUES ('node-1', 'res-1', $1, 0, 'hello', 'gw-1', 1)),
     f AS (UPDATE commands SET state = 'succeeded', finished_at = compute_now() WHERE id = $1)
SELECT pg_notify('leasehold_command_done', '')`, id)
	require.NoError(t, err)
	select {
	case <-finished:
	case <-time.After(30 * time.Second):
		t.Fatal("not woken by the notification sent after the outage")
	}
}
