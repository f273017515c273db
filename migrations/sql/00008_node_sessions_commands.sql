-- +goose Up
-- Node sessions and commands (docs/design.md#gateways). node_sessions routes a
-- node to the gateway that holds its stream: every Hello bumps session_epoch,
-- and every routing or liveness write carries AND session_epoch = <mine>, so a
-- gateway whose node said Hello elsewhere matches no row (a zombie session).
CREATE TABLE node_sessions (
    node_id            text        PRIMARY KEY REFERENCES nodes (id) ON DELETE CASCADE,
    gateway_id         text        NOT NULL,
    session_epoch      bigint      NOT NULL DEFAULT 1 CHECK (session_epoch >= 1),
    state              text        NOT NULL DEFAULT 'connected'
                                   CHECK (state IN ('connected', 'disconnected')),
    connected_at       timestamptz NOT NULL DEFAULT compute_now(),
    last_seen_at       timestamptz NOT NULL DEFAULT compute_now(),
    session_expires_at timestamptz NOT NULL,
    closed_at          timestamptz
);

CREATE INDEX node_sessions_gateway_idx ON node_sessions (gateway_id);

-- Commands are routed at dispatch time by joining node_sessions.gateway_id,
-- so a node that reconnects through another gateway needs nothing rewritten.
CREATE TABLE commands (
    id              text        PRIMARY KEY DEFAULT gen_random_uuid()::text
                                CHECK (length(id) BETWEEN 1 AND 200),
    node_id         text        NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    kind            text        NOT NULL CHECK (length(kind) BETWEEN 1 AND 100),
    payload         bytea       NOT NULL DEFAULT '',
    state           text        NOT NULL DEFAULT 'pending'
                                CHECK (state IN ('pending', 'dispatched', 'acknowledged', 'succeeded',
                                                 'failed', 'cancelled', 'expired')),
    deadline        timestamptz,
    idempotency_key text        CHECK (idempotency_key IS NULL OR length(idempotency_key) BETWEEN 1 AND 200),
    dispatch_count  integer     NOT NULL DEFAULT 0,
    -- gateway and session epoch of the latest dispatch, for operators
    dispatched_by   text,
    dispatch_epoch  bigint,
    dispatched_at   timestamptz,
    acked_at        timestamptz,
    finished_at     timestamptz,
    created_at      timestamptz NOT NULL DEFAULT compute_now(),
    UNIQUE (node_id, idempotency_key)
);

CREATE INDEX commands_pending_idx ON commands (node_id, created_at) WHERE state = 'pending';
CREATE INDEX commands_in_flight_idx ON commands (node_id) WHERE state IN ('dispatched', 'acknowledged');

-- Inserting a command wakes the gateways' dispatchers at once; the payload is
-- the node id so a gateway looks only at its own sessions. Dispatch still
-- polls when notifications are unavailable (PgBouncer transaction mode).
-- The channel name must match pgnotify.Commands (pkg/pgnotify/channels.go;
-- TestChannelsMatchMigrations checks it).
-- +goose StatementBegin
CREATE FUNCTION commands_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('leasehold_commands', NEW.node_id);
    RETURN NULL;
END $$;
-- +goose StatementEnd

CREATE TRIGGER commands_notify_insert AFTER INSERT ON commands
    FOR EACH ROW EXECUTE FUNCTION commands_notify();

-- +goose Down
DROP TRIGGER commands_notify_insert ON commands;
DROP FUNCTION commands_notify();
DROP TABLE commands;
DROP TABLE node_sessions;
