-- +goose Up
-- A database that went back in time: restored from an earlier backup (a
-- pg_dump, a snapshot) while processes that remember later epochs are still
-- running. Its lease rows carry the epochs of the backup, so without more the
-- next takes would hand out again epochs that were already handed out.
-- lease_epoch_floor() (migration 00014) does not help: a restore into the
-- same cluster keeps the WAL timeline, and the LSN keeps rising.
--
-- Three things, read by pkg/coord (restore.go; docs/database-failover.md):
--
--   * lease_grants counts changes of owner. Every grant statement returns it
--     and each process remembers the highest (floor, count) it has seen; a
--     database showing less went back in time. pg_dump saves the count with
--     the data, so a restore brings the old count back.
--   * leasehold_instance.generation is raised by the first process that
--     detects a regression. lease_epoch_floor() becomes
--     (generation << 48) + ((timeline - 1) << 32), so every epoch issued after
--     the detection is above every epoch of the earlier generation, whoever
--     remembers it (fewer than 2^16 timelines and 2^15 generations).
--   * epoch_regressions records each detection, for the db.restored finding
--     of leasehold-doctor, until an operator acknowledges it.
CREATE TABLE leasehold_instance (
    singleton     boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    id            uuid        NOT NULL DEFAULT gen_random_uuid(),
    generation    bigint      NOT NULL DEFAULT 0 CHECK (generation BETWEEN 0 AND 32767),
    created_at    timestamptz NOT NULL DEFAULT compute_now(),
    generation_at timestamptz
);
INSERT INTO leasehold_instance DEFAULT VALUES;

CREATE SEQUENCE lease_grants AS bigint;

CREATE TABLE epoch_regressions (
    id              bigserial   PRIMARY KEY,
    detected_at     timestamptz NOT NULL DEFAULT compute_now(),
    detected_by     text        NOT NULL,
    -- The lease whose row was behind the epoch detected_by held, or NULL
    -- when only the grant count (or floor) was behind.
    lease_name      text,
    seen_epoch      bigint,
    found_epoch     bigint,
    seen_floor      bigint      NOT NULL,
    found_floor     bigint      NOT NULL,
    seen_grants     bigint      NOT NULL,
    found_grants    bigint      NOT NULL,
    -- The generation this detection raised leasehold_instance to; NULL when
    -- a concurrent detection of the same regression had already raised it.
    raised_generation bigint,
    acknowledged_at timestamptz
);

CREATE INDEX epoch_regressions_open_idx ON epoch_regressions (detected_at) WHERE acknowledged_at IS NULL;

-- lease_restore_generation runs as its owner, so that lease_epoch_floor()
-- stays callable by a role without privileges on the tables, as before.
-- +goose StatementBegin
CREATE FUNCTION lease_restore_generation() RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE SECURITY DEFINER SET search_path FROM CURRENT
AS $$ SELECT coalesce((SELECT generation FROM leasehold_instance WHERE singleton), 0) $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION lease_epoch_floor() RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$ SELECT (lease_restore_generation() << 48)
           + ((('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint - 1) << 32) $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION lease_grant_count() RETURNS bigint
LANGUAGE sql VOLATILE
AS $$ SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM lease_grants $$;
-- +goose StatementEnd

-- lease_new_epoch is the epoch of a new holding of a row at current_epoch by
-- a process that has seen the lease at seen (0: never): above both and above
-- lease_epoch_floor(). It counts the grant.
-- +goose StatementBegin
CREATE FUNCTION lease_new_epoch(current_epoch bigint, seen bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    PERFORM nextval('lease_grants');
    RETURN GREATEST(current_epoch, lease_epoch_floor(), seen) + 1;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION lease_new_epoch(bigint, bigint);
DROP FUNCTION lease_grant_count();
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION lease_epoch_floor() RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$ SELECT (('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint - 1) << 32 $$;
-- +goose StatementEnd
DROP FUNCTION lease_restore_generation();
DROP TABLE epoch_regressions;
DROP SEQUENCE lease_grants;
DROP TABLE leasehold_instance;
