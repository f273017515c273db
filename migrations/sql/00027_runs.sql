-- +goose Up
-- Runs (docs/api.md, "Runs"): one command on many nodes. CreateRun resolves
-- the node set and writes the run with one run_nodes row per node in one
-- transaction; the worker's runs reconciler (sharded by run id) starts the
-- command of pending nodes, at most max_in_flight at a time, inserting the
-- command and marking its run_node running in the same fenced transaction,
-- so each node's command is created exactly once (docs/decisions.md, "Runs").
--
-- Additive only: two new tables that the previous release neither reads nor
-- writes, so a rolling upgrade is safe. Every time is the database's
-- (compute_now()).
CREATE TABLE IF NOT EXISTS runs (
    id              text        PRIMARY KEY DEFAULT gen_random_uuid()::text
                                CHECK (length(id) BETWEEN 1 AND 200),
    -- target as given: {"node_ids": [...], "selector": "...", "pool_id": "..."}
    target          jsonb       NOT NULL CHECK (jsonb_typeof(target) = 'object'),
    kind            text        NOT NULL CHECK (length(kind) BETWEEN 1 AND 100),
    payload         bytea       NOT NULL DEFAULT '',
    command_timeout interval    NOT NULL CHECK (command_timeout > interval '0'),
    -- resolved against the node count at creation
    max_in_flight   integer     NOT NULL CHECK (max_in_flight >= 1),
    max_failures    integer     NOT NULL CHECK (max_failures >= 0),
    batch_pause     interval    NOT NULL DEFAULT interval '0'
                                CHECK (batch_pause >= interval '0' AND batch_pause <= interval '1 hour'),
    state           text        NOT NULL DEFAULT 'running'
                                CHECK (state IN ('running', 'succeeded', 'failed', 'cancelled')),
    reason          text        NOT NULL DEFAULT '',
    idempotency_key text        CHECK (idempotency_key IS NULL OR length(idempotency_key) BETWEEN 1 AND 200),
    description     text        NOT NULL DEFAULT '' CHECK (octet_length(description) <= 200),
    -- the caller, as audit rows name it (sha256:<12 hex>)
    created_by      text        NOT NULL DEFAULT '',
    created_at      timestamptz NOT NULL DEFAULT compute_now(),
    finished_at     timestamptz,
    updated_at      timestamptz NOT NULL DEFAULT compute_now(),
    CHECK ((state = 'running') = (finished_at IS NULL))
);

-- A repeated CreateRun with the same key returns the first run.
CREATE UNIQUE INDEX IF NOT EXISTS runs_idempotency_key_idx ON runs (idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- ListRuns pages newest first.
CREATE INDEX IF NOT EXISTS runs_created_idx ON runs (created_at, id);
-- The reconciler's periodic requeue reads the running runs only.
CREATE INDEX IF NOT EXISTS runs_running_idx ON runs (id) WHERE state = 'running';

CREATE TABLE IF NOT EXISTS run_nodes (
    run_id      text        NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    node_id     text        NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    state       text        NOT NULL DEFAULT 'pending'
                            CHECK (state IN ('pending', 'running', 'succeeded', 'failed', 'unreachable',
                                             'skipped', 'not_started', 'cancelled')),
    -- the node's command once started (its idempotency key is run:<run_id>:<node_id>)
    command_id  text,
    exit_code   integer,
    -- the command's error, or why the node was skipped or not started
    error       text        NOT NULL DEFAULT '',
    started_at  timestamptz,
    finished_at timestamptz,
    updated_at  timestamptz NOT NULL DEFAULT compute_now(),
    PRIMARY KEY (run_id, node_id),
    CHECK (state IN ('pending', 'skipped', 'not_started') OR command_id IS NOT NULL)
);

-- A run's pending nodes in the order they start (node id).
CREATE INDEX IF NOT EXISTS run_nodes_pending_idx ON run_nodes (run_id, node_id) WHERE state = 'pending';
-- A run's running nodes, and which run a finished command belongs to.
CREATE INDEX IF NOT EXISTS run_nodes_running_idx ON run_nodes (command_id) WHERE state = 'running';
-- StreamRunNodes reads what changed since its last look.
CREATE INDEX IF NOT EXISTS run_nodes_updated_idx ON run_nodes (run_id, updated_at);

-- +goose Down
DROP TABLE IF EXISTS run_nodes;
DROP TABLE IF EXISTS runs;
