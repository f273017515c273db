-- +goose Up
-- The audit trail (docs/api.md, "Audit trail"): one row per mutating
-- ControlService call and per tunnel open or close, written in the same
-- transaction as the change it records, so a change without its row (or a
-- row without its change) cannot exist. The janitor deletes rows older than
-- its audit retention.
CREATE TABLE audit_events (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT compute_now(),
    -- actor names the caller's token without revealing it (apiauth.Identity.ID).
    actor       text NOT NULL,
    role        text NOT NULL,
    -- method is the ControlService method ("CancelCommand") or a tunnel
    -- event ("tunnel.open", "tunnel.close").
    method      text NOT NULL,
    target_kind text NOT NULL,
    target_id   text NOT NULL,
    -- outcome is "ok" for a change that committed, or what happened instead
    -- (for example "unchanged" when the call found nothing to change).
    outcome     text NOT NULL,
    detail      jsonb NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX audit_events_at ON audit_events (at);
CREATE INDEX audit_events_target ON audit_events (target_kind, target_id, id);
CREATE INDEX audit_events_actor ON audit_events (actor, id);

-- +goose Down
DROP TABLE audit_events;
