-- +goose Up
-- Sub-TTL takeover of a dead member (docs/high-availability.md, "Liveness
-- sessions"). A member that keeps a liveness session holds the session
-- advisory lock (liveness_lock_class(), hashtext(process_id)) on it and says
-- so here; survivors that find the lock free wait the self-fence deadline
-- plus a margin and then release the member's leases on its behalf.
ALTER TABLE workers ADD COLUMN liveness boolean NOT NULL DEFAULT false;

-- +goose Down
ALTER TABLE workers DROP COLUMN liveness;
