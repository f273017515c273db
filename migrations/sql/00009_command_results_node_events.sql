-- +goose Up
-- Command results and node events are facts: gateways accept them from any
-- session epoch and store each once, deduplicated by the id the node chose
-- (scoped to the node, so one node cannot shadow another's ids).
CREATE TABLE command_results (
    node_id       text        NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    id            text        NOT NULL CHECK (length(id) BETWEEN 1 AND 200),
    command_id    text        NOT NULL REFERENCES commands (id) ON DELETE CASCADE,
    exit_code     integer     NOT NULL,
    output        bytea       NOT NULL DEFAULT '',
    error         text        NOT NULL DEFAULT '',
    started_at    timestamptz,
    finished_at   timestamptz,
    received_at   timestamptz NOT NULL DEFAULT compute_now(),
    gateway_id    text        NOT NULL,
    session_epoch bigint      NOT NULL,
    PRIMARY KEY (node_id, id)
);

CREATE INDEX command_results_command_idx ON command_results (command_id);

CREATE TABLE node_events (
    node_id       text        NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    id            text        NOT NULL CHECK (length(id) BETWEEN 1 AND 200),
    kind          text        NOT NULL CHECK (length(kind) BETWEEN 1 AND 100),
    payload       jsonb       NOT NULL DEFAULT '{}'::jsonb,
    occurred_at   timestamptz,
    received_at   timestamptz NOT NULL DEFAULT compute_now(),
    gateway_id    text        NOT NULL,
    session_epoch bigint      NOT NULL,
    boot_epoch    bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (node_id, id)
);

CREATE INDEX node_events_received_idx ON node_events (node_id, received_at);

-- +goose Down
DROP TABLE node_events;
DROP TABLE command_results;
