package api

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/leasehold/leasehold/pkg/pgdb"
)

// auditEvent is one row of the audit trail (migration 00019): who changed
// what through ControlService or a tunnel, and how it ended.
type auditEvent struct {
	Method     string         // ControlService method, or "tunnel.open" / "tunnel.close"
	TargetKind string         // "node", "command", "pool", "pool_lease", "sink", "tunnel"
	TargetID   string         // the target's id
	Outcome    string         // "ok", or what happened instead ("unchanged", ...)
	Detail     map[string]any // small, non-secret facts about the change
}

const insertAuditSQL = `
INSERT INTO audit_events (actor, role, method, target_kind, target_id, outcome, detail)
VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb)`

// recordAudit writes ev with the caller of ctx as its actor through q, which
// should be the transaction that makes the change ev records, so the change
// and its audit row commit or roll back together. It also logs ev.
func (h *Handler) recordAudit(ctx context.Context, q pgdb.Querier, ev auditEvent) error {
	actor, role := "unauthenticated", "none"
	if id, ok := IdentityFrom(ctx); ok {
		actor, role = id.ID, id.Role.String()
	}
	if ev.Outcome == "" {
		ev.Outcome = "ok"
	}
	detail := []byte("{}")
	if len(ev.Detail) > 0 {
		var err error
		if detail, err = json.Marshal(ev.Detail); err != nil {
			return fmt.Errorf("audit %s: encode detail: %w", ev.Method, err)
		}
	}
	if _, err := q.Exec(ctx, insertAuditSQL, actor, role, ev.Method, ev.TargetKind, ev.TargetID, ev.Outcome, string(detail)); err != nil {
		return fmt.Errorf("audit %s %s %s: %w", ev.Method, ev.TargetKind, ev.TargetID, err)
	}
	h.log.InfoContext(ctx, "audit", "method", ev.Method, "target_kind", ev.TargetKind, "target_id", ev.TargetID,
		"outcome", ev.Outcome, "caller", actor, "role", role)
	return nil
}
