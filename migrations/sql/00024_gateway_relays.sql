-- +goose Up
-- The address each gateway relays tunnels on (docs/gateway.md
-- "Tunnels"): the api reaches the gateway that holds a node's session here.
-- A gateway writes its row at start, fenced on its gateway:<id> lease, with
-- the lease epoch; readers trust a row only while that lease is live, so a
-- row left by a dead gateway is never used.
CREATE TABLE gateway_relays (
    gateway_id  text        PRIMARY KEY CHECK (length(gateway_id) BETWEEN 1 AND 200),
    relay_addr  text        NOT NULL CHECK (length(relay_addr) BETWEEN 1 AND 300),
    lease_epoch bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT compute_now()
);

-- +goose Down
DROP TABLE gateway_relays;
