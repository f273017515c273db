-- +goose NO TRANSACTION
-- +goose Up
-- A command has one result. Results are deduplicated by (node_id, id), the
-- id the node chose, but a node could store any number of results with
-- different ids for one command; the gateway now keeps the first (its group
-- commit inserts a result only for a command without one, and ON CONFLICT
-- DO NOTHING covers a race between gateways) and counts the others as
-- ignored. The unique index makes it a rule of the database.
--
-- Duplicates stored before are removed first, keeping each command's first
-- result (the one the api's GetCommand already showed: earliest received_at,
-- then id). The index is built CONCURRENTLY so the upgrade does not block
-- result writes; it replaces command_results_command_idx, which it covers.
-- Should a duplicate slip in between the DELETE and the build (an old
-- gateway still running), the build fails and leaves an INVALID index:
-- drop it and run the migration again.
DELETE FROM command_results r
 USING command_results k
 WHERE k.command_id = r.command_id
   AND (k.received_at, k.id) < (r.received_at, r.id);
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS command_results_one_per_command
    ON command_results (command_id);
DROP INDEX CONCURRENTLY IF EXISTS command_results_command_idx;

-- +goose Down
CREATE INDEX CONCURRENTLY IF NOT EXISTS command_results_command_idx ON command_results (command_id);
DROP INDEX CONCURRENTLY IF EXISTS command_results_one_per_command;
