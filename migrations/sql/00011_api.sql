-- +goose Up
-- ControlService (services/api). Pools carry operator labels (CreatePool
-- labels, Pool.labels). Commands are listed newest first, overall and per
-- node, with keyset pagination on (created_at, id): these indexes keep a page
-- an index range scan however many commands the retention window holds (the
-- janitor's age-based delete uses commands_created_idx too).
ALTER TABLE pools ADD COLUMN labels jsonb NOT NULL DEFAULT '{}'::jsonb
    CHECK (jsonb_typeof(labels) = 'object');

CREATE INDEX commands_created_idx ON commands (created_at, id);
CREATE INDEX commands_node_created_idx ON commands (node_id, created_at, id);
CREATE INDEX pool_leases_created_idx ON pool_leases (created_at, id);

-- +goose Down
DROP INDEX pool_leases_created_idx;
DROP INDEX commands_node_created_idx;
DROP INDEX commands_created_idx;
ALTER TABLE pools DROP COLUMN labels;
