-- +goose Up
-- Each gateway's lag and whether it reports overload (docs/gateway.md
-- "Overload"): written by the gateway every 15 s and whenever its overload
-- changes, fenced on its gateway:<id> lease; the api refuses new commands
-- for the nodes of an overloaded gateway. Readers trust a row only while
-- that lease is live, so a row left by a dead gateway is never used. A new
-- table: the previous release neither writes nor reads it.
CREATE TABLE gateway_load (
    gateway_id  text        PRIMARY KEY CHECK (length(gateway_id) BETWEEN 1 AND 200),
    lease_epoch bigint      NOT NULL,
    lag_ms      integer     NOT NULL CHECK (lag_ms >= 0),
    overloaded  boolean     NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT compute_now()
);

-- +goose Down
DROP TABLE gateway_load;
