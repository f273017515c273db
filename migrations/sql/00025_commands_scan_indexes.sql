-- +goose NO TRANSACTION
-- +goose Up
-- The periodic readers of commands cost what they return, not the size of
-- the table (docs/decisions.md "Throughput"). Before these, the
-- metrics:command-latency collector and the sweeper each scanned every row
-- on every pass: 30-130 ms a pass at 60,000 rows, growing with retained
-- history and with any backlog, on the same two cores as dispatch.
--
-- commands_finished_idx serves the collector's "finished since the
-- watermark" read; only a command's finishing write adds an entry.
-- commands_deadline_idx serves the sweeper's expiry; a command without a
-- deadline never enters it. Both are built CONCURRENTLY so an upgrade does
-- not block command writes while they build.
CREATE INDEX CONCURRENTLY IF NOT EXISTS commands_finished_idx
    ON commands (finished_at) WHERE finished_at IS NOT NULL;
CREATE INDEX CONCURRENTLY IF NOT EXISTS commands_deadline_idx
    ON commands (deadline)
    WHERE deadline IS NOT NULL AND state IN ('pending', 'dispatched', 'acknowledged');

-- +goose Down
DROP INDEX CONCURRENTLY IF EXISTS commands_deadline_idx;
DROP INDEX CONCURRENTLY IF EXISTS commands_finished_idx;
