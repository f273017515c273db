-- +goose NO TRANSACTION
-- +goose Up
-- The idempotency index covers the keyed commands only. UNIQUE (node_id,
-- idempotency_key) indexed every command, though most have no key, so every
-- insert and every state change that is not HOT wrote an entry for nothing.
-- Every statement that inserts commands names the conflict target with its
-- predicate (ON CONFLICT (node_id, idempotency_key) WHERE idempotency_key IS
-- NOT NULL, pkg/cmdstore), which infers the partial index as it inferred
-- the constraint, so a process of the previous release keeps working while
-- this runs. The new index is built CONCURRENTLY before the constraint is
-- dropped, so keys stay unique throughout; dropping the constraint takes a
-- brief exclusive lock, bounded by a lock_timeout (run the migration again
-- if it times out).
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS commands_idempotency_idx
    ON commands (node_id, idempotency_key) WHERE idempotency_key IS NOT NULL;
-- A build that failed leaves an INVALID index, which IF NOT EXISTS would
-- skip: the constraint is dropped only beside a valid index.
-- +goose StatementBegin
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                    WHERE c.relname = 'commands_idempotency_idx' AND i.indisvalid) THEN
        RAISE EXCEPTION 'commands_idempotency_idx is not valid: DROP INDEX CONCURRENTLY commands_idempotency_idx, then run the migration again';
    END IF;
    PERFORM set_config('lock_timeout', '10s', true);
    ALTER TABLE commands DROP CONSTRAINT IF EXISTS commands_node_id_idempotency_key_key;
END $$;
-- +goose StatementEnd

-- +goose Down
ALTER TABLE commands ADD CONSTRAINT commands_node_id_idempotency_key_key UNIQUE (node_id, idempotency_key);
DROP INDEX CONCURRENTLY IF EXISTS commands_idempotency_idx;
