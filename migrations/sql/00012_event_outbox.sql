-- +goose Up
-- Sinks read node_events in commit order. An identity seq alone is not
-- enough: a transaction that took a lower seq can commit after a higher one
-- was delivered, and a seq cursor would skip it. Each event also records its
-- inserting transaction id; a sink reads only events of transactions older
-- than every transaction still in progress (pg_snapshot_xmin), ordered by
-- (txid, seq), and keeps both as its cursor.
ALTER TABLE node_events ADD COLUMN txid xid8 NOT NULL DEFAULT pg_current_xact_id();
CREATE INDEX node_events_outbox_idx ON node_events (txid, seq);
ALTER TABLE sink_cursors ADD COLUMN cursor_txid bigint NOT NULL DEFAULT 0;

-- Why a session ended: NULL while connected or when its gateway closed the
-- stream; 'gateway_lost' when a worker found the gateway's lease expired
-- (the node then gets the 120 s gateway-loss grace before unreachable);
-- 'session_expired' when liveness stopped under a live gateway lease.
ALTER TABLE node_sessions ADD COLUMN close_reason text
    CHECK (close_reason IS NULL OR close_reason IN ('gateway_lost', 'session_expired'));

-- +goose Down
ALTER TABLE node_sessions DROP COLUMN close_reason;
ALTER TABLE sink_cursors DROP COLUMN cursor_txid;
DROP INDEX node_events_outbox_idx;
ALTER TABLE node_events DROP COLUMN txid;
