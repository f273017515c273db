-- +goose Up
-- Membership rows. id is "<worker>" for the controllers group and
-- "scheduler/<worker>" for the scheduler group (docs/design.md#membership).
CREATE TABLE workers (
    id            text        PRIMARY KEY CHECK (length(id) BETWEEN 1 AND 200),
    member_group  text        NOT NULL DEFAULT 'controllers',
    process_id    text        NOT NULL DEFAULT '',
    hostname      text        NOT NULL DEFAULT '',
    version       text        NOT NULL DEFAULT '',
    started_at    timestamptz NOT NULL DEFAULT compute_now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT compute_now(),
    -- Last measured offset of the process clock against compute_now(), in ms;
    -- doctor reports |clock_skew_ms| > 1000 as leases.clock_skew.
    clock_skew_ms bigint      NOT NULL DEFAULT 0
);

CREATE INDEX workers_group_heartbeat_idx ON workers (member_group, heartbeat_at);

-- +goose Down
DROP TABLE workers;
