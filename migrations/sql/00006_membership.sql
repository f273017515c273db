-- +goose Up
-- How this process hears lease releases: 'listen' (LISTEN/NOTIFY on a direct
-- connection) or 'polling' (behind a transaction pooler without a direct URL).
ALTER TABLE workers ADD COLUMN notify_mode text NOT NULL DEFAULT 'polling'
    CHECK (notify_mode IN ('listen', 'polling'));
-- The leases this member held at its last pass (shards and singletons): doctor
-- shows who holds orphaned shards without joining on owner ids.
ALTER TABLE workers ADD COLUMN leases_held integer NOT NULL DEFAULT 0;

-- Periodic singletons record the last period they completed inside the
-- transaction fenced on their lease, so a takeover neither skips nor repeats
-- a period.
CREATE TABLE singleton_periods (
    job            text        PRIMARY KEY CHECK (length(job) BETWEEN 1 AND 200),
    period_ms      bigint      NOT NULL CHECK (period_ms > 0),
    last_period    bigint      NOT NULL,
    completed_at   timestamptz NOT NULL DEFAULT compute_now(),
    completed_by   text        NOT NULL,
    lease_epoch    bigint      NOT NULL
);

-- Sink-style singletons save their cursor after every delivered batch; a new
-- epoch resumes from it (at-least-once delivery).
CREATE TABLE sink_cursors (
    sink_id     text        PRIMARY KEY CHECK (length(sink_id) BETWEEN 1 AND 200),
    cursor      bigint      NOT NULL DEFAULT 0,
    lease_epoch bigint      NOT NULL DEFAULT 0,
    updated_at  timestamptz NOT NULL DEFAULT compute_now()
);

-- +goose Down
DROP TABLE sink_cursors;
DROP TABLE singleton_periods;
ALTER TABLE workers DROP COLUMN leases_held;
ALTER TABLE workers DROP COLUMN notify_mode;
