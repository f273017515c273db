-- +goose Up
-- The fence locks the lease row FOR KEY SHARE instead of FOR SHARE.
-- FOR KEY SHARE conflicts only with an UPDATE that changes a key column (a
-- column of a unique index). This index makes epoch such a column, and every
-- change of owner raises the epoch: so a takeover (and a fresh take) still
-- waits for every open fenced transaction, while a renewal, which moves only
-- expires_at, no longer waits behind fenced work. name alone is already
-- unique; the index exists for its lock semantics, not for lookups.
CREATE UNIQUE INDEX leases_name_epoch_key ON leases (name, epoch);

-- +goose Down
DROP INDEX leases_name_epoch_key;
