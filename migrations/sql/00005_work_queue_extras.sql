-- +goose Up
-- Claim order of the work queue (pkg/queue claimSQL): a key has been waiting
-- since LEAST(due_at, claimed_until), which is due_at for an unclaimed key
-- (LEAST ignores NULL) and the claim's end for a claimed one. This index lets
-- a worker that holds many shards take the earliest keys without sorting the
-- whole backlog (100k keys: 38 ms -> 2 ms per claim of 100). A worker holding
-- few shards still uses work_queue_due_idx (shard, due_at). The expression
-- must stay identical to the one in pkg/queue's claim statement.
CREATE INDEX work_queue_claim_idx ON work_queue (reconciler, (LEAST(due_at, claimed_until)));

-- +goose Down
DROP INDEX work_queue_claim_idx;
