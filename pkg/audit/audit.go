// Package audit writes the audit trail (the audit_events table): who did
// what to which target and how it ended. The api records every change made
// through ControlService and every tunnel it relays; a gateway records every
// tunnel opened on its relay, whoever opened it. Rows are facts: written in
// the transaction that makes the change where there is one, never updated.
package audit

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/leasehold/leasehold/pkg/pgdb"
)

// Event is one row of the audit trail.
type Event struct {
	// Actor is who acted (an api token's id, "join-token:<id>",
	// "node:<id>", or the actor a relay call names); Role its role
	// ("viewer" … "admin", "join-token", "node", "relay").
	Actor, Role string
	// Method is what was done: a ControlService method, or
	// "tunnel.open"/"tunnel.close" (the api), "relay.open"/"relay.close"
	// (a gateway's relay).
	Method string
	// TargetKind and TargetID name what it was done to ("node", "command",
	// "pool", "pool_lease", "sink", "tunnel").
	TargetKind, TargetID string
	// Outcome is "ok", or what happened instead ("unchanged", a Connect
	// code's name).
	Outcome string
	// Detail holds small, non-secret facts about the change.
	Detail map[string]any
}

const insertSQL = `
INSERT INTO audit_events (actor, role, method, target_kind, target_id, outcome, detail)
VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb)`

// Record writes ev through q, which should be the transaction that makes
// the change ev records, so the change and its row commit or roll back
// together. An empty Outcome is "ok".
func Record(ctx context.Context, q pgdb.Querier, ev Event) error {
	outcome, detail, err := ev.columns()
	if err != nil {
		return err
	}
	if _, err := q.Exec(ctx, insertSQL, ev.Actor, ev.Role, ev.Method, ev.TargetKind, ev.TargetID, outcome, detail); err != nil {
		return fmt.Errorf("audit %s %s %s: %w", ev.Method, ev.TargetKind, ev.TargetID, err)
	}
	return nil
}

// columns is ev's outcome ("ok" when empty) and its detail as JSON text.
func (ev Event) columns() (outcome, detail string, err error) {
	outcome, detail = ev.Outcome, "{}"
	if outcome == "" {
		outcome = "ok"
	}
	if len(ev.Detail) > 0 {
		b, err := json.Marshal(ev.Detail)
		if err != nil {
			return "", "", fmt.Errorf("audit %s: encode detail: %w", ev.Method, err)
		}
		detail = string(b)
	}
	return outcome, detail, nil
}

const insertManySQL = `
INSERT INTO audit_events (actor, role, method, target_kind, target_id, outcome, detail)
SELECT a, r, m, k, t, o, d::jsonb
  FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[]) AS e(a, r, m, k, t, o, d)`

// RecordMany writes evs through q in one statement, as Record writes one:
// q should be the transaction that makes the changes they record. Nothing
// is written when an event's detail does not encode.
func RecordMany(ctx context.Context, q pgdb.Querier, evs []Event) error {
	if len(evs) == 0 {
		return nil
	}
	cols := make([][]string, 7)
	for i := range cols {
		cols[i] = make([]string, len(evs))
	}
	for i, ev := range evs {
		outcome, detail, err := ev.columns()
		if err != nil {
			return err
		}
		cols[0][i], cols[1][i], cols[2][i], cols[3][i] = ev.Actor, ev.Role, ev.Method, ev.TargetKind
		cols[4][i], cols[5][i], cols[6][i] = ev.TargetID, outcome, detail
	}
	if _, err := q.Exec(ctx, insertManySQL, cols[0], cols[1], cols[2], cols[3], cols[4], cols[5], cols[6]); err != nil {
		return fmt.Errorf("audit %d events: %w", len(evs), err)
	}
	return nil
}

// maxDetailText bounds a text in an event's detail.
const maxDetailText = 200

// Short cuts s to at most 200 bytes of valid UTF-8 for an event's detail
// (an error message, a signal name), marking a cut with "…".
func Short(s string) string {
	if len(s) <= maxDetailText {
		return strings.ToValidUTF8(s, "")
	}
	return strings.ToValidUTF8(s[:maxDetailText], "") + "…"
}
