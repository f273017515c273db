-- +goose Up
-- One row per lease. owner is NULL while nobody holds it; epoch rises on every
-- change of owner and never on renewal; expires_at '-infinity' means released.
CREATE TABLE leases (
    name       text        PRIMARY KEY
                           CHECK (name ~ '^[A-Za-z0-9._:@/-]{1,200}$'),
    owner      text,
    epoch      bigint      NOT NULL DEFAULT 0 CHECK (epoch >= 0),
    expires_at timestamptz NOT NULL DEFAULT '-infinity',
    acquired_at timestamptz
);

CREATE INDEX leases_owner_idx ON leases (owner) WHERE owner IS NOT NULL;

-- +goose Down
DROP TABLE leases;
