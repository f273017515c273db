-- +goose Up
-- The work queue of sharded reconcilers (docs/design.md#work-queue). A key is claimed
-- only by the holder of its shard's lease; a run deletes it only at the
-- generation it claimed, so an enqueue during a run is never lost.
CREATE TABLE work_queue (
    reconciler    text        NOT NULL CHECK (length(reconciler) BETWEEN 1 AND 100),
    key           text        NOT NULL CHECK (length(key) BETWEEN 1 AND 500),
    shard         smallint    NOT NULL CHECK (shard BETWEEN 0 AND 255),
    generation    bigint      NOT NULL DEFAULT 1,
    due_at        timestamptz NOT NULL DEFAULT compute_now(),
    claimed_by    text,
    claimed_until timestamptz,
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text,
    enqueued_at   timestamptz NOT NULL DEFAULT compute_now(),
    PRIMARY KEY (reconciler, key)
);

CREATE INDEX work_queue_due_idx ON work_queue (shard, due_at);

-- +goose Down
DROP TABLE work_queue;
