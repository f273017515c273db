-- +goose NO TRANSACTION
-- +goose Up
-- Enrollment (docs/node.md, "Enrollment"; docs/api.md, "Enrollment"). A join
-- token is a secret "lhj_<id>.<secret>" an admin hands to machines; each
-- EnrollmentService.Join exchanges it for the machine's own node credential,
-- at most max_uses times before expires_at. Only the token's SHA-256 is
-- stored. Join locks the token row FOR UPDATE, so concurrent joins count
-- uses one at a time and never exceed max_uses (the CHECK says so as well).
--
-- Additive only, so the previous release keeps working during a rolling
-- upgrade: a new table, a nullable column and a new index. It runs outside a
-- transaction because the index is built CONCURRENTLY (credential writes and
-- the gateways' Hello keep going while it builds); every statement is
-- idempotent, so a run interrupted half way completes when run again.
CREATE TABLE IF NOT EXISTS join_tokens (
    -- id is the public part of the token (before the dot): safe to show and log.
    id          text        PRIMARY KEY CHECK (id ~ '^[0-9a-f]{16}$'),
    -- secret_hash is the SHA-256 of the whole token as handed out.
    secret_hash bytea       NOT NULL CHECK (length(secret_hash) = 32),
    description text        NOT NULL DEFAULT '' CHECK (octet_length(description) <= 200),
    -- labels are assigned to every node that joins with the token.
    labels      jsonb       NOT NULL DEFAULT '{}'::jsonb CHECK (jsonb_typeof(labels) = 'object'),
    pool_id     text        REFERENCES pools (id),
    max_uses    integer     NOT NULL CHECK (max_uses BETWEEN 1 AND 100000),
    uses        integer     NOT NULL DEFAULT 0 CHECK (uses >= 0 AND uses <= max_uses),
    created_at  timestamptz NOT NULL DEFAULT compute_now(),
    expires_at  timestamptz NOT NULL,
    revoked_at  timestamptz,
    CHECK (expires_at > created_at),
    CHECK (revoked_at IS NULL OR revoked_at >= created_at)
);

-- ListJoinTokens lists newest first.
CREATE INDEX IF NOT EXISTS join_tokens_created_idx ON join_tokens (created_at, id);

-- An admin lets an existing node join again (ControlService.AllowReenroll)
-- until reenroll_until; a Join that re-enrolls clears it. The previous
-- release neither reads nor writes it.
ALTER TABLE nodes ADD COLUMN IF NOT EXISTS reenroll_until timestamptz;

-- A credential is live while revoked_at IS NULL OR revoked_at > compute_now():
-- RotateCredential leaves the old credential a grace period by setting its
-- revoked_at in the future. node_credentials_live_idx (revoked_at IS NULL)
-- cannot hold those rows and a partial index cannot name the clock, so
-- nodeauth.Verify reads this index instead: node_id, then the time the
-- credential dies (never, for NULL). Verify's
--   coalesce(revoked_at, 'infinity') > (SELECT compute_now())
-- is a range scan of it that touches only the node's live credentials,
-- however many old ones a node has rotated through. The old partial index
-- stays: the previous release's Verify and revoke still use it.
CREATE INDEX CONCURRENTLY IF NOT EXISTS node_credentials_unexpired_idx
    ON node_credentials (node_id, (coalesce(revoked_at, 'infinity'::timestamptz)));

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS node_credentials_unexpired_idx;
ALTER TABLE nodes DROP COLUMN IF EXISTS reenroll_until;
DROP TABLE IF EXISTS join_tokens;
