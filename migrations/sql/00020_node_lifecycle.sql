-- +goose Up
-- Node lifecycle (docs/cli.md, "Drain a node"; docs/api.md, DrainNode): a
-- cordoned node keeps what runs on it, but the placer allocates it to no
-- new pool lease. The placer reads cordoned_at in the same statement that
-- locks the candidate row, and CordonNode's UPDATE takes a conflicting row
-- lock, so a cordon and a placement are serialised: once CordonNode has
-- returned, no placement of the node can commit.
ALTER TABLE nodes ADD COLUMN cordoned_at timestamptz;

-- +goose Down
ALTER TABLE nodes DROP COLUMN cordoned_at;
