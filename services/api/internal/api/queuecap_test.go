package api

import (
	"net/http"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
)

// TestCreateCommandRefusesAFullQueue: with --api.max-queued-per-node 3 a
// node that has three commands pending gets no fourth (RESOURCE_EXHAUSTED
// naming the flag, nothing written), another node still does, a repeat of
// an idempotent create still gets its command, and once one of the three
// has left the pending state the node takes one again.
func TestCreateCommandRefusesAFullQueue(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *Config, _ *http.Transport) { c.MaxQueuedPerNode = 3 })
	ctx := ctxT(t)
	b.registerNode("node-1", nil)
	b.registerNode("node-2", nil)
	create := func(node, key string) (*connect.Response[controlv1.CreateCommandResponse], error) {
		return b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{
			NodeId: node, Kind: "exec", Payload: []byte(`{"argv":["true"]}`), IdempotencyKey: key}))
	}
	var first string
	for i, key := range []string{"k-1", "k-2", "k-3"} {
		r, err := create("node-1", key)
		require.NoError(t, err)
		if i == 0 {
			first = r.Msg.GetCommand().GetId()
		}
	}
	_, err := create("node-1", "k-4")
	ce := requireConnectError(t, err, connect.CodeResourceExhausted)
	require.Contains(t, ce.Message(), "--api.max-queued-per-node")
	require.Contains(t, ce.Message(), `node "node-1" has 3 commands queued`)
	require.Equal(t, 3, b.count(`SELECT count(*) FROM commands WHERE node_id = 'node-1'`), "the refused command is not written")

	again, err := create("node-1", "k-2")
	require.NoError(t, err, "a repeat of an idempotent create gets its command even when the queue is full")
	require.False(t, again.Msg.GetCreated())
	_, err = create("node-2", "k-4")
	require.NoError(t, err, "the cap is per node")

	b.exec(`UPDATE commands SET state = 'dispatched', dispatched_at = compute_now() WHERE id = $1`, first)
	r, err := create("node-1", "k-4")
	require.NoError(t, err, "a dispatched command no longer counts")
	require.True(t, r.Msg.GetCreated())
}
