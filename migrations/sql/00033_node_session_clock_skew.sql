-- +goose Up
-- Each session's node clock minus the database clock, in milliseconds, as
-- its gateway last measured it from the node's heartbeats (the node's
-- sent_at against the gateway's clock, corrected by the gateway's own skew
-- against compute_now()); written by the gateway's batched liveness write,
-- read by leasehold-doctor (nodes.clock_skew). NULL until measured. Adding
-- a nullable column without a default rewrites nothing and takes a brief
-- lock only: gateways of the previous release keep working and leave it
-- NULL.
ALTER TABLE node_sessions ADD COLUMN IF NOT EXISTS clock_skew_ms integer;

-- +goose Down
ALTER TABLE node_sessions DROP COLUMN IF EXISTS clock_skew_ms;
