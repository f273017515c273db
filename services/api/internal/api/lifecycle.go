package api

import (
	"context"
	"errors"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/durationpb"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

// Node lifecycle (docs/api.md, "CordonNode", "DrainNode", "DecommissionNode"): a
// cordon keeps the placer off a node, a drain cordons it and waits for its
// work to end, a decommission drains it and then revokes its credential.

// drainPoll is how often a drain re-reads what still runs on the node.
const drainPoll = 250 * time.Millisecond

// maxReason bounds a lifecycle call's reason (characters).
const maxReason = 200

// nodeWork is what keeps a node from being drained.
type nodeWork struct {
	commands, poolLeases []string
}

func (w nodeWork) drained() bool { return len(w.commands) == 0 && len(w.poolLeases) == 0 }

func readNodeWork(ctx context.Context, q pgdb.Querier, id string) (nodeWork, error) {
	var w nodeWork
	err := q.QueryRow(ctx, nodeWorkSQL, id).Scan(&w.commands, &w.poolLeases)
	return w, err
}

// validateNodeChange checks the fields every lifecycle call shares.
func validateNodeChange(id, reason string) error {
	if err := checkRE("node_id", id, idRE); err != nil {
		return err
	}
	return checkText("reason", reason, maxReason)
}

// drainWait resolves a drain's timeout: unset is 0, at most MaxWait, and
// never past the caller's own deadline (less waitMargin).
func drainWait(ctx context.Context, d interface{ GetTimeout() *durationpb.Duration }) (time.Duration, error) {
	wait := time.Duration(0)
	if d.GetTimeout() != nil {
		v, err := checkDuration("timeout", d.GetTimeout(), 0, MaxWait)
		if err != nil {
			return 0, err
		}
		wait = v
	}
	if dl, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(dl)-waitMargin)
	}
	return max(wait, 0), nil
}

// cordon marks node id cordoned in one transaction with its audit row
// (outcome "unchanged" when it already was), and returns the node.
func (h *Handler) cordon(ctx context.Context, method, id, reason string) (*controlv1.Node, error) {
	var node *controlv1.Node
	err := pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		var was bool
		if err := tx.QueryRow(ctx, lockNodeForCordonSQL, id).Scan(&was); errors.Is(err, pgx.ErrNoRows) {
			return notFound("node_id", "node", id)
		} else if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, cordonNodeSQL, id); err != nil {
			return err
		}
		var err error
		if node, err = scanNode(tx.QueryRow(ctx, getNodeSQL, id)); err != nil {
			return err
		}
		return h.recordAudit(ctx, tx, auditEvent{Method: method, TargetKind: "node", TargetID: id,
			Outcome: outcome(!was), Detail: reasonDetail(reason, "cordon")})
	})
	return node, err
}

func reasonDetail(reason, step string) map[string]any {
	d := map[string]any{"step": step}
	if reason != "" {
		d["reason"] = reason
	}
	return d
}

// waitDrained polls what runs on node id until it is drained, wait has
// passed, or ctx ends; it returns the last reading.
func (h *Handler) waitDrained(ctx context.Context, id string, wait time.Duration) (nodeWork, error) {
	tick := time.NewTicker(drainPoll)
	defer tick.Stop()
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for last := false; ; {
		w, err := readNodeWork(ctx, h.db, id)
		if err != nil || w.drained() || last {
			return w, err
		}
		select {
		case <-ctx.Done():
			return w, ctx.Err()
		case <-h.waiter.stopping():
			return w, nil
		case <-timer.C:
			last = true // one reading at the deadline, then the answer
		case <-tick.C:
		}
	}
}

// CordonNode keeps the placer from allocating the node to new pool leases.
func (h *Handler) CordonNode(ctx context.Context, req *connect.Request[controlv1.CordonNodeRequest]) (*connect.Response[controlv1.CordonNodeResponse], error) {
	m := req.Msg
	if err := validateNodeChange(m.GetNodeId(), m.GetReason()); err != nil {
		return nil, err
	}
	node, err := h.cordon(ctx, "CordonNode", m.GetNodeId(), m.GetReason())
	if err != nil {
		return nil, h.fail(ctx, "cordon node", err)
	}
	return connect.NewResponse(&controlv1.CordonNodeResponse{Node: node}), nil
}

// UncordonNode lets the placer allocate the node again.
func (h *Handler) UncordonNode(ctx context.Context, req *connect.Request[controlv1.UncordonNodeRequest]) (*connect.Response[controlv1.UncordonNodeResponse], error) {
	id := req.Msg.GetNodeId()
	if err := checkRE("node_id", id, idRE); err != nil {
		return nil, err
	}
	var node *controlv1.Node
	err := pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, uncordonNodeSQL, id)
		if err != nil {
			return err
		}
		if node, err = scanNode(tx.QueryRow(ctx, getNodeSQL, id)); errors.Is(err, pgx.ErrNoRows) {
			return notFound("node_id", "node", id)
		} else if err != nil {
			return err
		}
		return h.recordAudit(ctx, tx, auditEvent{Method: "UncordonNode", TargetKind: "node", TargetID: id,
			Outcome: outcome(tag.RowsAffected() > 0)})
	})
	if err != nil {
		return nil, h.fail(ctx, "uncordon node", err)
	}
	return connect.NewResponse(&controlv1.UncordonNodeResponse{Node: node}), nil
}

// DrainNode cordons the node and waits, up to its timeout, until no
// command is dispatched to or running on it and no pool lease holds it.
// A wait that ends first is not an error: drained is false and the
// response lists what is still there; calling again resumes the wait.
func (h *Handler) DrainNode(ctx context.Context, req *connect.Request[controlv1.DrainNodeRequest]) (*connect.Response[controlv1.DrainNodeResponse], error) {
	m := req.Msg
	if err := validateNodeChange(m.GetNodeId(), m.GetReason()); err != nil {
		return nil, err
	}
	wait, err := drainWait(ctx, m)
	if err != nil {
		return nil, err
	}
	node, err := h.cordon(ctx, "DrainNode", m.GetNodeId(), m.GetReason())
	if err != nil {
		return nil, h.fail(ctx, "drain node", err)
	}
	w, err := h.waitDrained(ctx, m.GetNodeId(), wait)
	if err != nil {
		return nil, h.fail(ctx, "drain node", err)
	}
	return connect.NewResponse(&controlv1.DrainNodeResponse{Node: node, Drained: w.drained(),
		RunningCommandIds: w.commands, PoolLeaseIds: w.poolLeases}), nil
}

// DecommissionNode drains the node and, once nothing runs on it, revokes
// its credential and closes its session in one transaction that checks
// again that it is drained. A node still busy when the wait ends stays
// cordoned, unrevoked, and decommissioned is false.
func (h *Handler) DecommissionNode(ctx context.Context, req *connect.Request[controlv1.DecommissionNodeRequest]) (*connect.Response[controlv1.DecommissionNodeResponse], error) {
	m := req.Msg
	id := m.GetNodeId()
	if err := validateNodeChange(id, m.GetReason()); err != nil {
		return nil, err
	}
	wait, err := drainWait(ctx, m)
	if err != nil {
		return nil, err
	}
	node, err := h.cordon(ctx, "DecommissionNode", id, m.GetReason())
	if err != nil {
		return nil, h.fail(ctx, "decommission node", err)
	}
	w, err := h.waitDrained(ctx, id, wait)
	if err != nil {
		return nil, h.fail(ctx, "decommission node", err)
	}
	resp := &controlv1.DecommissionNodeResponse{Node: node}
	if w.drained() {
		err = pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
			state, err := lockNodeForRevoke(ctx, tx, id)
			if err != nil {
				return err
			}
			// Checked again under the lock: a command dispatched since
			// the wait keeps the node.
			if w, err = readNodeWork(ctx, tx, id); err != nil || !w.drained() {
				return err
			}
			if err := revokeLocked(ctx, tx, id, state); err != nil {
				return err
			}
			resp.Decommissioned = true
			if resp.Node, err = scanNode(tx.QueryRow(ctx, getNodeSQL, id)); err != nil {
				return err
			}
			return h.recordAudit(ctx, tx, auditEvent{Method: "DecommissionNode", TargetKind: "node", TargetID: id,
				Outcome: outcome(state != "revoked"), Detail: reasonDetail(m.GetReason(), "revoke")})
		})
		if err != nil {
			return nil, h.fail(ctx, "decommission node", err)
		}
	}
	resp.RunningCommandIds, resp.PoolLeaseIds = w.commands, w.poolLeases
	return connect.NewResponse(resp), nil
}
