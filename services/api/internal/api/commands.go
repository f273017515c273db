package api

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/tracing"
)

// maxListPayloadBytes bounds the payload bytes of one ListCommands page: a
// page ends early (with a next_page_token) rather than grow past it.
const maxListPayloadBytes = 4 << 20

type createCommand struct {
	timeout  time.Duration // 0 when a deadline is given
	deadline time.Time
	key      *string
}

// deadlineAt is the command's deadline when the database clock reads now:
// now plus its timeout, or the deadline it gave, which must then fall
// MinCommandTimeout..MaxCommandTimeout after now.
func (c createCommand) deadlineAt(now time.Time) (time.Time, error) {
	if c.timeout > 0 {
		return now.Add(c.timeout), nil
	}
	if left := c.deadline.Sub(now); left < MinCommandTimeout || left > MaxCommandTimeout {
		return time.Time{}, invalid("deadline", "must be %s..%s after the current time", MinCommandTimeout, MaxCommandTimeout)
	}
	return c.deadline, nil
}

// revokedNode refuses a command for a revoked node.
func revokedNode(nodeID string) error {
	return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("node_id: node %q is revoked", nodeID))
}

// checkKindPayloadSize checks a command's kind and its payload's size
// (CreateCommand and CreateRun); the payload's content is checkPayload's,
// run after every other field.
func checkKindPayloadSize(kind string, payload []byte, maxPayload int) error {
	if err := checkRE("kind", kind, kindRE); err != nil {
		return err
	}
	if len(payload) > maxPayload {
		return invalid("payload", "must be at most %d bytes (--api.max-payload-bytes), got %d", maxPayload, len(payload))
	}
	return nil
}

func validateCreateCommand(m *controlv1.CreateCommandRequest, defaultTimeout time.Duration, maxPayload int) (createCommand, error) {
	var c createCommand
	if err := checkRE("node_id", m.GetNodeId(), idRE); err != nil {
		return c, err
	}
	if err := checkKindPayloadSize(m.GetKind(), m.GetPayload(), maxPayload); err != nil {
		return c, err
	}
	switch e := m.GetExpiry().(type) {
	case *controlv1.CreateCommandRequest_Deadline:
		t, err := checkTimestamp("deadline", e.Deadline)
		if err != nil {
			return c, err
		}
		c.deadline = t
	case *controlv1.CreateCommandRequest_Timeout:
		d, err := checkDuration("timeout", e.Timeout, MinCommandTimeout, MaxCommandTimeout)
		if err != nil {
			return c, err
		}
		c.timeout = d
	default:
		c.timeout = defaultTimeout
	}
	if k := m.GetIdempotencyKey(); k != "" {
		if err := checkRE("idempotency_key", k, idempotencyKeyRE); err != nil {
			return c, err
		}
		c.key = &k
	}
	// A typed kind's payload is parsed last, so every other field's error
	// comes first; other kinds stay opaque to the api.
	if err := checkPayload(m.GetKind(), m.GetPayload()); err != nil {
		return c, err
	}
	return c, nil
}

// CreateCommand queues a command. With an idempotency key, a repeat with
// the same kind and payload returns the first command (created=false); the
// same key with other content is ALREADY_EXISTS. The deadline is counted on
// the database clock.
func (h *Handler) CreateCommand(ctx context.Context, req *connect.Request[controlv1.CreateCommandRequest]) (*connect.Response[controlv1.CreateCommandResponse], error) {
	m := req.Msg
	c, err := validateCreateCommand(m, h.defaultTimeout, h.maxPayload)
	if err != nil {
		return nil, err
	}
	payload := m.GetPayload()
	if payload == nil {
		payload = []byte{}
	}
	// Refused under overload before any database work, unless a repeat of
	// an idempotent create may be owed its command (decided in the
	// transaction).
	if c.key == nil {
		if refusal := h.overloadRefusal(m.GetNodeId()); refusal != nil {
			return nil, refusal
		}
	}
	if c.key == nil && h.group != nil {
		actor, role := auditActor(ctx)
		cmd, err := h.group.create(&pendingCreate{ctx: ctx, m: m, payload: payload, c: c,
			traceparent: traceparentArg(tracing.Traceparent(ctx)), actor: actor, role: role, done: make(chan createAnswer, 1)})
		if !errors.Is(err, errGroupStopped) {
			if err != nil {
				return nil, h.fail(ctx, "create command", err)
			}
			h.wake.Created(m.GetNodeId()) // after the commit: the gateways see the row
			return connect.NewResponse(&controlv1.CreateCommandResponse{Command: cmd, Created: true}), nil
		}
	}
	resp := &controlv1.CreateCommandResponse{}
	err = pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		var (
			state  string
			now    time.Time
			queued int
		)
		if err := tx.QueryRow(ctx, lockNodeForCommandSQL, m.GetNodeId(), h.maxQueued).Scan(&state, &now, &queued); errors.Is(err, pgx.ErrNoRows) {
			return notFound("node_id", "node", m.GetNodeId())
		} else if err != nil {
			return err
		}
		if state == "revoked" {
			return revokedNode(m.GetNodeId())
		}
		if refusal := h.admit(m.GetNodeId(), queued); refusal != nil {
			// A repeat of an idempotent create still gets its command.
			if c.key != nil {
				if cmd, _, err := scanCommand(tx.QueryRow(ctx, commandByKeySQL, m.GetNodeId(), *c.key)); err == nil {
					return h.repeated(ctx, tx, m, payload, cmd, resp)
				} else if !errors.Is(err, pgx.ErrNoRows) {
					return err
				}
			}
			return refusal
		}
		deadline, err := c.deadlineAt(now)
		if err != nil {
			return err
		}
		cmd, _, err := scanCommand(tx.QueryRow(ctx, insertCommandSQL, m.GetNodeId(), m.GetKind(), payload, deadline, c.key,
			traceparentArg(tracing.Traceparent(ctx))))
		if err == nil {
			resp.Command, resp.Created = cmd, true
			return h.recordAudit(ctx, tx, auditEvent{Method: "CreateCommand", TargetKind: "command", TargetID: cmd.GetId(),
				Detail: map[string]any{"node_id": m.GetNodeId(), "kind": m.GetKind()}})
		}
		if !errors.Is(err, pgx.ErrNoRows) || c.key == nil {
			return err
		}
		// The key is taken: the insert waited for the other transaction,
		// so the row is committed and visible to this new statement.
		cmd, _, err = scanCommand(tx.QueryRow(ctx, commandByKeySQL, m.GetNodeId(), *c.key))
		if err != nil {
			return err
		}
		return h.repeated(ctx, tx, m, payload, cmd, resp)
	})
	if err != nil {
		return nil, h.fail(ctx, "create command", err)
	}
	if resp.Created {
		h.wake.Created(m.GetNodeId()) // after the commit: the gateways see the row
	}
	return connect.NewResponse(resp), nil
}

// admit refuses a new command for nodeID (a RESOURCE_EXHAUSTED refusal,
// nil to admit it) when the node has --api.max-queued-per-node commands
// queued (queued, counted by the node lock), or when the gateway holding
// its session reports overload (overload.go).
func (h *Handler) admit(nodeID string, queued int) *connect.Error {
	if h.maxQueued > 0 && queued >= h.maxQueued {
		return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf(
			"node_id: node %q has %d commands queued already (--api.max-queued-per-node); retry once some have run", nodeID, queued))
	}
	return h.overloadRefusal(nodeID)
}

// overloadRefusal is admit's overload half, nil without
// --api.overload-admission.
func (h *Handler) overloadRefusal(nodeID string) *connect.Error {
	if h.overload == nil {
		return nil
	}
	return h.overload.refusal(nodeID)
}

// repeated answers a CreateCommand whose idempotency key names cmd already:
// the same kind and payload get cmd (created false, audited as unchanged:
// a repeat changes nothing); other content is ALREADY_EXISTS.
func (h *Handler) repeated(ctx context.Context, tx pgx.Tx, m *controlv1.CreateCommandRequest, payload []byte, cmd *controlv1.Command, resp *controlv1.CreateCommandResponse) error {
	if cmd.GetKind() != m.GetKind() || !bytes.Equal(cmd.GetPayload(), payload) {
		return connect.NewError(connect.CodeAlreadyExists, fmt.Errorf(
			"idempotency_key: already used for command %s of node %q with another kind or payload", cmd.GetId(), m.GetNodeId()))
	}
	resp.Command = cmd
	return h.recordAudit(ctx, tx, auditEvent{Method: "CreateCommand", TargetKind: "command", TargetID: cmd.GetId(),
		Outcome: outcomeUnchanged, Detail: map[string]any{"node_id": m.GetNodeId(), "kind": m.GetKind()}})
}

// readCommand returns the command and its result (nil when none).
func (h *Handler) readCommand(ctx context.Context, id string) (*controlv1.Command, *controlv1.CommandResult, error) {
	cmd, _, err := scanCommand(h.db.QueryRow(ctx, getCommandSQL, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil, notFound("command_id", "command", id)
	}
	if err != nil {
		return nil, nil, err
	}
	res, err := scanResult(h.db.QueryRow(ctx, resultSQL, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return cmd, nil, nil
	}
	if err != nil {
		return nil, nil, err
	}
	return cmd, res, nil
}

// GetCommand returns one command and its result, if any.
func (h *Handler) GetCommand(ctx context.Context, req *connect.Request[controlv1.GetCommandRequest]) (*connect.Response[controlv1.GetCommandResponse], error) {
	id := req.Msg.GetCommandId()
	if err := checkRE("command_id", id, idRE); err != nil {
		return nil, err
	}
	cmd, res, err := h.readCommand(ctx, id)
	if err != nil {
		return nil, h.fail(ctx, "get command", err)
	}
	return connect.NewResponse(&controlv1.GetCommandResponse{Command: cmd, Result: res}), nil
}

// ListCommands returns commands newest first.
func (h *Handler) ListCommands(ctx context.Context, req *connect.Request[controlv1.ListCommandsRequest]) (*connect.Response[controlv1.ListCommandsResponse], error) {
	const method = "ListCommands"
	m := req.Msg
	if err := checkPage(m.GetPageSize(), m.GetPageToken()); err != nil {
		return nil, err
	}
	if err := checkOptionalRE("node_id", m.GetNodeId(), idRE); err != nil {
		return nil, err
	}
	if err := checkEnum("state", m.GetState(), controlv1.CommandState_name, true); err != nil {
		return nil, err
	}
	p, err := openPage(method, m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	resp := &controlv1.ListCommandsResponse{}
	err = h.readList(ctx, "list commands", func(ctx context.Context, q pgdb.Querier) error {
		rows, err := q.Query(ctx, listCommandsSQL, p.after.after(), p.after.ID, m.GetNodeId(), dbName(commandStates, m.GetState()), p.limit())
		if err != nil {
			return err
		}
		resp.Commands, resp.NextPageToken, err = collectPageWithin(p, rows, func(r pgx.Rows) (*controlv1.Command, pageKey, error) {
			c, created, err := scanCommand(r)
			return c, pageKey{ID: c.GetId(), At: created.UnixMicro()}, err
		}, func(c *controlv1.Command) int { return len(c.GetPayload()) }, maxListPayloadBytes)
		return err
	})
	if err != nil {
		return nil, h.fail(ctx, "list commands", err)
	}
	return connect.NewResponse(resp), nil
}

// CancelCommand moves a pending, dispatched or running command to
// cancelled; a finished command is returned unchanged. A command its node
// was given also gets cancel_requested_at: the node's gateway sends it
// CancelCommand (now, or after the node's next Hello) and the node's
// answer sets cancel_confirmed (docs/api.md, "Cancellation").
func (h *Handler) CancelCommand(ctx context.Context, req *connect.Request[controlv1.CancelCommandRequest]) (*connect.Response[controlv1.CancelCommandResponse], error) {
	id := req.Msg.GetCommandId()
	if err := checkRE("command_id", id, idRE); err != nil {
		return nil, err
	}
	var cmd *controlv1.Command
	err := pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		var err error
		cmd, err = h.cancelCommandTx(ctx, tx, id, nil)
		return err
	})
	if err != nil {
		return nil, h.fail(ctx, "cancel command", err)
	}
	h.wakeCancelled(cmd)
	return connect.NewResponse(&controlv1.CancelCommandResponse{Command: cmd}), nil
}

// cancelCommandTx is CancelCommand's change in tx: it cancels command id
// if it has not finished (asking its node to stop when it was given one)
// and records the audit row, with extra facts in detail (CancelRun names
// its run). The caller calls wakeCancelled after the commit.
func (h *Handler) cancelCommandTx(ctx context.Context, tx pgx.Tx, id string, detail map[string]any) (*controlv1.Command, error) {
	ev := auditEvent{Method: "CancelCommand", TargetKind: "command", TargetID: id}
	cmd, _, err := scanCommand(tx.QueryRow(ctx, cancelCommandSQL, id))
	if errors.Is(err, pgx.ErrNoRows) {
		cmd, _, err = scanCommand(tx.QueryRow(ctx, getCommandSQL, id))
		if errors.Is(err, pgx.ErrNoRows) {
			return nil, notFound("command_id", "command", id)
		}
		ev.Outcome = "unchanged"
	}
	if err != nil {
		return nil, err
	}
	ev.Detail = map[string]any{"node_id": cmd.GetNodeId(), "state": dbName(commandStates, cmd.GetState()),
		"deliver_to_node": ev.Outcome == "" && cmd.GetCancelRequestedAt() != nil}
	for k, v := range detail {
		ev.Detail[k] = v
	}
	return cmd, h.recordAudit(ctx, tx, ev)
}

// wakeCancelled wakes the gateway of a cancelled command's node, after the
// commit, when the node must be told (as for a new command).
func (h *Handler) wakeCancelled(cmd *controlv1.Command) {
	if cmd.GetCancelRequestedAt() != nil && !cmd.GetCancelConfirmed() {
		h.wake.Created(cmd.GetNodeId())
	}
}

// waitMargin is kept back from the caller's own deadline so the answer
// (the command as it stands) arrives before the caller gives up.
const waitMargin = 200 * time.Millisecond

// WaitCommand waits until the command is terminal, the timeout passes, the
// caller's deadline is near or the server stops, then returns the command
// as it stands.
func (h *Handler) WaitCommand(ctx context.Context, req *connect.Request[controlv1.WaitCommandRequest]) (*connect.Response[controlv1.WaitCommandResponse], error) {
	m := req.Msg
	id := m.GetCommandId()
	if err := checkRE("command_id", id, idRE); err != nil {
		return nil, err
	}
	wait := DefaultWait
	if m.GetTimeout() != nil {
		d, err := checkDuration("timeout", m.GetTimeout(), 0, MaxWait)
		if err != nil {
			return nil, err
		}
		wait = d
	}
	if dl, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(dl)-waitMargin)
	}
	cmd, res, err := h.readCommand(ctx, id)
	if err != nil {
		return nil, h.fail(ctx, "wait command", err)
	}
	if !terminalCommand(cmd.GetState()) && wait > 0 {
		finished, cancel := h.waiter.register(id)
		timer := time.NewTimer(wait)
		select {
		case <-finished:
		case <-timer.C:
		case <-h.waiter.stopping():
		case <-ctx.Done():
		}
		timer.Stop()
		cancel()
		if ctx.Err() != nil {
			return nil, h.fail(ctx, "wait command", ctx.Err())
		}
		if cmd, res, err = h.readCommand(ctx, id); err != nil {
			return nil, h.fail(ctx, "wait command", err)
		}
	}
	return connect.NewResponse(&controlv1.WaitCommandResponse{Command: cmd, Result: res}), nil
}
