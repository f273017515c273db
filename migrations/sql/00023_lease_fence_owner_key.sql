-- +goose Up
-- The fence locks the lease row FOR KEY SHARE, which conflicts
-- only with an UPDATE that changes a key column (a column of a unique,
-- non-partial index without expressions). Migration 00015 made epoch one,
-- so a takeover waits for every open fenced transaction. This index makes
-- owner one too, so that every write that ends a holding changes a key
-- column and waits: a release by the holder, and a release on behalf of a
-- dead member (liveness), set owner NULL and keep the epoch. A renewal
-- moves only expires_at and does not wait. name alone is already unique;
-- the index exists for its lock semantics, not for lookups.
CREATE UNIQUE INDEX leases_name_owner_key ON leases (name, owner);

-- +goose Down
DROP INDEX leases_name_owner_key;
