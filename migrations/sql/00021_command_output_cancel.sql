-- +goose Up
-- Live command output and cancellation that reaches the node
-- (docs/gateway.md "Live output" and "Cancellation").
--
-- command_output holds the pieces of a command's stdout and stderr as the
-- node wrote them, keyed by the byte offset the daemon gave each piece (a
-- re-sent piece is stored once). The gateway stores at most its per-command
-- cap; past it one row of stream 'truncated' (no data) marks where output
-- was dropped. Rows go with their command (ON DELETE CASCADE), and the
-- janitor deletes them earlier, after its output retention.
CREATE TABLE command_output (
    command_id text        NOT NULL REFERENCES commands (id) ON DELETE CASCADE,
    "offset"   bigint      NOT NULL CHECK ("offset" >= 0),
    stream     text        NOT NULL CHECK (stream IN ('stdout', 'stderr', 'truncated')),
    data       bytea       NOT NULL,
    stored_at  timestamptz NOT NULL DEFAULT compute_now(),
    PRIMARY KEY (command_id, "offset")
);

-- How much output is stored, and whether it was truncated, is read from
-- the command's last command_output row (one index probe), not kept on
-- commands: the group commit must not change a commands row twice in one
-- statement, and a result and output of one command often share a batch.
--
-- cancel_requested_at is set by
-- CancelCommand of a dispatched or acknowledged command; cancel_sent_epoch
-- is the session epoch at which a gateway last sent the node CancelCommand
-- (sent again at every new epoch until confirmed); cancel_confirmed_at and
-- cancel_outcome are the node's answer.
ALTER TABLE commands
    ADD COLUMN cancel_requested_at timestamptz,
    ADD COLUMN cancel_sent_epoch   bigint,
    ADD COLUMN cancel_confirmed_at timestamptz,
    ADD COLUMN cancel_outcome      text CHECK (cancel_outcome IN ('stopped', 'already_finished', 'not_started'));

-- The cancels still to deliver, per node: small, read at every dispatch round.
CREATE INDEX commands_cancel_pending_idx ON commands (node_id)
    WHERE cancel_requested_at IS NOT NULL AND cancel_confirmed_at IS NULL;

-- +goose Down
DROP INDEX commands_cancel_pending_idx;
ALTER TABLE commands
    DROP COLUMN cancel_requested_at,
    DROP COLUMN cancel_sent_epoch,
    DROP COLUMN cancel_confirmed_at,
    DROP COLUMN cancel_outcome;
DROP TABLE command_output;
