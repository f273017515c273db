-- +goose Up
-- Pools group nodes; a pool lease is a tenant's request for N nodes of a pool
-- matching a label selector. The scheduler's placer (sharded by pool id,
-- fenced on scheduler/shard:<n>) allocates connected nodes to pending pool
-- leases; node_allocations' primary key makes a node allocatable only once.
CREATE TABLE pools (
    id          text        PRIMARY KEY CHECK (id ~ '^[A-Za-z0-9._:@-]{1,200}$'),
    description text        NOT NULL DEFAULT '' CHECK (length(description) <= 1000),
    created_at  timestamptz NOT NULL DEFAULT compute_now()
);

-- Nodes join a pool at registration (or later through the API).
ALTER TABLE nodes ADD COLUMN pool_id text REFERENCES pools (id) ON DELETE SET NULL;
CREATE INDEX nodes_pool_idx ON nodes (pool_id) WHERE pool_id IS NOT NULL;

CREATE TABLE pool_leases (
    id              text        PRIMARY KEY DEFAULT gen_random_uuid()::text,
    pool_id         text        NOT NULL REFERENCES pools (id) ON DELETE CASCADE,
    tenant          text        NOT NULL CHECK (tenant ~ '^[A-Za-z0-9._:@-]{1,200}$'),
    count           integer     NOT NULL CHECK (count BETWEEN 1 AND 10000),
    selector        jsonb       NOT NULL DEFAULT '{}'::jsonb,
    state           text        NOT NULL DEFAULT 'pending'
                                CHECK (state IN ('pending', 'allocated', 'released')),
    idempotency_key text        CHECK (idempotency_key IS NULL OR length(idempotency_key) BETWEEN 1 AND 200),
    created_at      timestamptz NOT NULL DEFAULT compute_now(),
    allocated_at    timestamptz,
    released_at     timestamptz,
    UNIQUE (tenant, idempotency_key)
);

CREATE INDEX pool_leases_pending_idx ON pool_leases (pool_id, created_at) WHERE state = 'pending';

-- One row per allocated node: the primary key is what makes a double
-- allocation impossible, whatever the placer does.
CREATE TABLE node_allocations (
    node_id       text        PRIMARY KEY REFERENCES nodes (id) ON DELETE CASCADE,
    pool_lease_id text        NOT NULL REFERENCES pool_leases (id) ON DELETE CASCADE,
    pool_id       text        NOT NULL,
    allocated_at  timestamptz NOT NULL DEFAULT compute_now(),
    -- epoch of the scheduler shard lease the placer held when it allocated
    placer_epoch  bigint      NOT NULL,
    placed_by     text        NOT NULL
);

CREATE INDEX node_allocations_lease_idx ON node_allocations (pool_lease_id);

-- Event sinks: each has a singleton:sink:<id> lease and a cursor in
-- sink_cursors. The webhook secret signs deliveries (HMAC-SHA256).
CREATE TABLE sinks (
    id         text        PRIMARY KEY CHECK (id ~ '^[A-Za-z0-9._-]{1,100}$'),
    kind       text        NOT NULL DEFAULT 'webhook' CHECK (kind IN ('webhook')),
    url        text        NOT NULL CHECK (length(url) BETWEEN 1 AND 2000),
    secret     text        NOT NULL CHECK (length(secret) BETWEEN 16 AND 500),
    created_at timestamptz NOT NULL DEFAULT compute_now()
);

-- Node events get a global order for sink cursors.
ALTER TABLE node_events ADD COLUMN seq bigint GENERATED ALWAYS AS IDENTITY;
CREATE UNIQUE INDEX node_events_seq_idx ON node_events (seq);

-- +goose Down
DROP INDEX node_events_seq_idx;
ALTER TABLE node_events DROP COLUMN seq;
DROP TABLE sinks;
DROP TABLE node_allocations;
DROP TABLE pool_leases;
DROP INDEX nodes_pool_idx;
ALTER TABLE nodes DROP COLUMN pool_id;
DROP TABLE pools;
