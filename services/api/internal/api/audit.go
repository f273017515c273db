package api

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/leasehold/leasehold/pkg/audit"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
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
	// Actor and Role name a caller that has no api token (EnrollmentService:
	// "join-token:<id>" / "join-token", "node:<id>" / "node"); empty: the
	// caller of the context.
	Actor, Role string
}

// recordAudit writes ev with the caller of ctx as its actor through q, which
// should be the transaction that makes the change ev records, so the change
// and its audit row commit or roll back together. It also logs ev.
func (h *Handler) recordAudit(ctx context.Context, q pgdb.Querier, ev auditEvent) error {
	actor, role := auditActor(ctx)
	if ev.Actor != "" {
		actor, role = ev.Actor, ev.Role
	}
	if ev.Outcome == "" {
		ev.Outcome = "ok"
	}
	if err := audit.Record(ctx, q, audit.Event{Actor: actor, Role: role, Method: ev.Method, TargetKind: ev.TargetKind, TargetID: ev.TargetID,
		Outcome: ev.Outcome, Detail: ev.Detail}); err != nil {
		return err
	}
	h.logAudit(ctx, ev.Method, ev.TargetKind, ev.TargetID, ev.Outcome, actor, role)
	return nil
}

// logAudit logs an audit row that was written (recordAudit, a create
// group), once its transaction holds it.
func (h *Handler) logAudit(ctx context.Context, method, targetKind, targetID, outcome, actor, role string) {
	h.log.InfoContext(ctx, "audit", "method", method, "target_kind", targetKind, "target_id", targetID,
		"outcome", outcome, "caller", actor, "role", role)
}

// auditActor is who ctx's caller is in the audit trail: its token's id
// and role, or "unauthenticated".
func auditActor(ctx context.Context) (actor, role string) {
	if id, ok := IdentityFrom(ctx); ok {
		return id.ID, id.Role.String()
	}
	return "unauthenticated", "none"
}

// Audit outcomes other than "ok".
const outcomeUnchanged = "unchanged"

// outcome is "ok" for a call that changed something, "unchanged" for one
// that found nothing to change (a second revoke, the cancel of a finished
// command).
func outcome(changed bool) string {
	if changed {
		return "ok"
	}
	return outcomeUnchanged
}

var (
	auditMethodRE = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9._]{0,63}$`)
	auditKindRE   = regexp.MustCompile(`^[a-z][a-z_]{0,31}$`)
)

const listAuditEventsSQL = `
SELECT id, at, actor, role, method, target_kind, target_id, outcome, detail
  FROM audit_events
 WHERE ($1::bigint = 0 OR id < $1)
   AND ($2 = '' OR actor = $2) AND ($3 = '' OR method = $3)
   AND ($4 = '' OR target_kind = $4) AND ($5 = '' OR target_id = $5)
   AND ($6::timestamptz IS NULL OR at >= $6) AND ($7::timestamptz IS NULL OR at < $7)
 ORDER BY id DESC LIMIT $8`

type auditFilter struct {
	since, until *time.Time
}

func validateListAuditEvents(m *controlv1.ListAuditEventsRequest) (auditFilter, error) {
	var f auditFilter
	if err := checkPage(m.GetPageSize(), m.GetPageToken()); err != nil {
		return f, err
	}
	if err := checkText("actor", m.GetActor(), 200); err != nil {
		return f, err
	}
	if err := checkOptionalRE("method", m.GetMethod(), auditMethodRE); err != nil {
		return f, err
	}
	if err := checkOptionalRE("target_kind", m.GetTargetKind(), auditKindRE); err != nil {
		return f, err
	}
	if err := checkOptionalRE("target_id", m.GetTargetId(), idRE); err != nil {
		return f, err
	}
	if m.GetTargetId() != "" && m.GetTargetKind() == "" {
		return f, invalid("target_id", "needs target_kind")
	}
	if m.Since != nil {
		t, err := checkTimestamp("since", m.GetSince())
		if err != nil {
			return f, err
		}
		f.since = &t
	}
	if m.Until != nil {
		t, err := checkTimestamp("until", m.GetUntil())
		if err != nil {
			return f, err
		}
		f.until = &t
	}
	if f.since != nil && f.until != nil && !f.since.Before(*f.until) {
		return f, invalid("until", "must be after since")
	}
	return f, nil
}

// ListAuditEvents returns audit events newest first (by id, the order they
// were written), filtered by actor, method, target and time.
func (h *Handler) ListAuditEvents(ctx context.Context, req *connect.Request[controlv1.ListAuditEventsRequest]) (*connect.Response[controlv1.ListAuditEventsResponse], error) {
	const method = "ListAuditEvents"
	m := req.Msg
	f, err := validateListAuditEvents(m)
	if err != nil {
		return nil, err
	}
	p, err := openPage(method, m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	var after int64
	if p.after.ID != "" {
		if after, err = strconv.ParseInt(p.after.ID, 10, 64); err != nil || after <= 0 {
			return nil, invalid("page_token", "is not a page token of %s", method)
		}
	}
	resp := &controlv1.ListAuditEventsResponse{}
	err = h.readList(ctx, "list audit events", func(ctx context.Context, q pgdb.Querier) error {
		rows, err := q.Query(ctx, listAuditEventsSQL, after, m.GetActor(), m.GetMethod(), m.GetTargetKind(), m.GetTargetId(),
			f.since, f.until, p.limit())
		if err != nil {
			return err
		}
		resp.Events, resp.NextPageToken, err = collectPage(p, rows, func(r pgx.Rows) (*controlv1.AuditEvent, pageKey, error) {
			e, err := scanAuditEvent(r)
			return e, pageKey{ID: strconv.FormatInt(e.GetId(), 10)}, err
		})
		return err
	})
	if err != nil {
		return nil, h.fail(ctx, "list audit events", err)
	}
	return connect.NewResponse(resp), nil
}

func scanAuditEvent(r pgx.Row) (*controlv1.AuditEvent, error) {
	var (
		e      controlv1.AuditEvent
		at     time.Time
		detail map[string]any
	)
	if err := r.Scan(&e.Id, &at, &e.Actor, &e.Role, &e.Method, &e.TargetKind, &e.TargetId, &e.Outcome, &detail); err != nil {
		return &e, err
	}
	e.At = ts(at)
	var err error
	if e.Detail, err = structpb.NewStruct(detail); err != nil {
		return &e, fmt.Errorf("audit event %d detail: %w", e.Id, err)
	}
	return &e, nil
}
