-- +goose Up
-- Epochs that stay unique across a failover to an asynchronous standby.
--
-- A standby promoted after the primary died may lack the primary's last
-- commits, among them lease grants: an epoch E given to holder A on the old
-- primary can be given again, to holder B, by the new one. The fence compares
-- owner and epoch, so A's fenced writes still fail there; but anything outside
-- the database that remembers an epoch (a site agent's boot grant, a node's
-- session, a sink's cursor) could see two holders at E.
--
-- Every promotion starts a new WAL timeline, and the timeline is visible to a
-- write transaction at once (pg_walfile_name names the current insert
-- timeline). lease_epoch_floor() is (timeline - 1) << 32, so every epoch
-- issued on timeline T is above every epoch issued on an earlier timeline
-- (fewer than 2^32 changes of owner per row per timeline). On a cluster that
-- never failed over (timeline 1) the floor is 0: epochs count 1, 2, 3, ...
-- See docs/failure-modes.md, "Failover to a standby".
-- +goose StatementBegin
CREATE FUNCTION lease_epoch_floor() RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$ SELECT (('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint - 1) << 32 $$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION lease_epoch_floor();
