package gateway

import (
	"context"
	"fmt"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// Cancellation (docs/gateway.md, "Cancellation"): the api's CancelCommand
// of a dispatched or acknowledged command marks it cancelled and sets
// cancel_requested_at, then wakes the node's gateway the way a new command
// does. The wake-up's first dispatch call, in its transaction fenced on
// the gateway lease and right after the commands, takes the woken nodes'
// unconfirmed cancels not yet sent at their current session epochs,
// records the epoch (cancel_sent_epoch) and queues a CancelCommand for
// each (sendCancels does it alone when the wake-up made no dispatch
// call). A Hello wakes dispatch for its node, so a node that was offline
// gets its cancels right after Welcome (and the replays); a cancel lost
// with a session is sent again at the next epoch. The node's CancelAck goes through the group
// commit and sets cancel_confirmed_at and cancel_outcome.

// cancelOutcomes maps CancelAck outcomes to commands.cancel_outcome.
var cancelOutcomes = map[nodev1.CancelOutcome]string{
	nodev1.CancelOutcome_CANCEL_OUTCOME_STOPPED:          "stopped",
	nodev1.CancelOutcome_CANCEL_OUTCOME_ALREADY_FINISHED: "already_finished",
	nodev1.CancelOutcome_CANCEL_OUTCOME_NOT_STARTED:      "not_started",
}

// takeCancelsSQL marks the unconfirmed cancels of the given sessions' nodes
// as sent at each session's epoch, and returns them, only for sessions this
// gateway holds at those epochs.
const takeCancelsSQL = `
UPDATE commands c SET cancel_sent_epoch = s.session_epoch
  FROM unnest($2::text[], $3::bigint[]) AS m(node_id, epoch)
  JOIN node_sessions s ON s.node_id = m.node_id AND s.session_epoch = m.epoch AND s.gateway_id = $1
 WHERE c.node_id = m.node_id
   AND c.cancel_requested_at IS NOT NULL AND c.cancel_confirmed_at IS NULL
   AND c.cancel_sent_epoch IS DISTINCT FROM s.session_epoch
RETURNING c.id, c.node_id, s.session_epoch`

// takenCancel is a cancel takeCancelsSQL marked sent at a session's epoch.
type takenCancel struct {
	id, node string
	epoch    int64
}

func scanCancels(rows pgx.Rows) ([]takenCancel, error) {
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (takenCancel, error) {
		var c takenCancel
		return c, r.Scan(&c.id, &c.node, &c.epoch)
	})
}

// sendCancels takes the cancels of the given sessions in a fenced
// transaction of its own and sends them. A wake-up's first dispatch call
// takes them in its own transaction instead (dispatchOnce); this runs only
// when a wake-up made no dispatch call (every window full, say), since a
// cancel is what frees a slot of a node that stops its command.
func (g *Gateway) sendCancels(ctx context.Context, ids []string, epochs []int64) error {
	var taken []takenCancel
	err := g.runFenced(ctx, func(ctx context.Context, tx pgx.Tx) error {
		rows, err := tx.Query(ctx, takeCancelsSQL, g.id, ids, epochs)
		if err != nil {
			return err
		}
		taken, err = scanCancels(rows)
		return err
	})
	if err != nil {
		return fmt.Errorf("take cancels: %w", err)
	}
	g.deliverCancels(taken)
	return nil
}

// deliverCancels queues a CancelCommand on each taken cancel's session.
func (g *Gateway) deliverCancels(taken []takenCancel) {
	for _, c := range taken {
		g.mu.Lock()
		s := g.sessions[c.node]
		g.mu.Unlock()
		if s != nil && s.epoch == c.epoch && s.enqueue(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_CancelCommand{
			CancelCommand: &nodev1.CancelCommand{CommandId: c.id}}}) {
			g.m.cancels.WithLabelValues("sent").Inc()
			continue
		}
		// The stream ended meanwhile: the next Hello is a new epoch, which
		// sends the cancel again.
		g.log.Debug("cancel has no open stream; it is sent after the next Hello", "node", c.node, "command", c.id)
	}
}

func (g *Gateway) handleCancelAck(s *session, a *nodev1.CancelAck) *connect.Error {
	if id := a.GetCommandId(); id == "" || len(id) > maxIDLen {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("cancel_ack.command_id must be 1..%d bytes", maxIDLen))
	}
	outcome, ok := cancelOutcomes[a.GetOutcome()]
	if !ok {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("cancel_ack.outcome %v is not a known outcome", a.GetOutcome()))
	}
	if s.answered(a.GetCommandId(), g.clock.Now()) { // a node that stops a command may not send its result
		g.wakeDispatch(s.nodeID)
	}
	g.ingest.submit(&ingestItem{kind: ingestCancelAck, s: s, id: a.GetCommandId(), stream: outcome})
	return nil
}
