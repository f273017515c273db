-- +goose Up
-- Registered nodes (compute nodes and site agents) and their credentials
-- (docs/design.md#gateways and #observability). A credential is a high-entropy random token
-- returned once at registration; only its SHA-256 is stored, and gateways
-- compare hashes in constant time. A node may have several live credentials
-- during a rotation; revoking sets revoked_at.
CREATE TABLE nodes (
    id             text        PRIMARY KEY CHECK (id ~ '^[A-Za-z0-9._:@-]{1,200}$'),
    kind           text        NOT NULL DEFAULT 'node' CHECK (kind IN ('node', 'site_agent')),
    site_id        text        CHECK (site_id IS NULL OR length(site_id) BETWEEN 1 AND 200),
    -- labels the node reports about itself on Hello
    labels         jsonb       NOT NULL DEFAULT '{}'::jsonb,
    -- desired spec sent in Welcome: {"labels":{}, "desired_state":"", "attributes":{}}
    spec           jsonb       NOT NULL DEFAULT '{}'::jsonb,
    state          text        NOT NULL DEFAULT 'registered'
                               CHECK (state IN ('registered', 'connected', 'disconnected', 'unreachable', 'revoked')),
    -- session epoch the last state transition observed: a transition made
    -- for an older epoch never overwrites a newer Hello's.
    state_epoch    bigint      NOT NULL DEFAULT 0,
    daemon_version text        NOT NULL DEFAULT '',
    created_at     timestamptz NOT NULL DEFAULT compute_now(),
    updated_at     timestamptz NOT NULL DEFAULT compute_now()
);

CREATE INDEX nodes_site_idx ON nodes (site_id) WHERE site_id IS NOT NULL;

CREATE TABLE node_credentials (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    node_id         text        NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    credential_hash bytea       NOT NULL CHECK (length(credential_hash) = 32),
    created_at      timestamptz NOT NULL DEFAULT compute_now(),
    revoked_at      timestamptz
);

CREATE INDEX node_credentials_live_idx ON node_credentials (node_id) WHERE revoked_at IS NULL;

-- +goose Down
DROP TABLE node_credentials;
DROP TABLE nodes;
