-- +goose Up
-- What a command costs PostgreSQL (docs/decisions.md, "What a command costs
-- PostgreSQL"). A command used to be one row inserted and changed three
-- times, none of them HOT, plus a command_results row of its own with two
-- index entries and two foreign-key checks (each a row lock, so a WAL
-- record, on the node and on the command). This migration:
--
-- * stores the result in the command's own row (the result_* columns), so
--   the finishing write is the one that records the result. Dedup stays
--   what it was: a result is stored once per command (the first), a repeat
--   of its id is a duplicate, another id is ignored.
-- * keeps "acknowledged" out of every index: the gateway records an ack as
--   acked_at alone, which no index names, so the ack is a HOT update. The
--   state a reader shows is command_state(state, acked_at).
-- The table keeps the default fillfactor: leaving a fifth of each page
-- free for HOT updates was measured and made overload worse (docs/
-- decisions.md, "What a command costs PostgreSQL").
--
-- Rolling upgrade: a gateway of the previous release keeps writing
-- command_results rows and the 'acknowledged' state, and both stay valid.
-- Readers go through command_results_all, which is the results stored in
-- commands followed by those in command_results, and through
-- command_state, which maps both forms of an ack to 'acknowledged'. The
-- new gateway stores a result only for a command with none in either place.
-- A later release moves the remaining command_results rows and drops the
-- table. Adding nullable columns without defaults rewrites nothing; the
-- lock_timeout keeps this from queueing command writes behind a long
-- transaction (the migration fails and can be run again).
SET LOCAL lock_timeout = '10s';

ALTER TABLE commands
    ADD COLUMN result_id            text CHECK (result_id IS NULL OR length(result_id) BETWEEN 1 AND 200),
    ADD COLUMN result_exit_code     integer,
    ADD COLUMN result_output        bytea,
    ADD COLUMN result_error         text,
    ADD COLUMN result_started_at    timestamptz,
    ADD COLUMN result_finished_at   timestamptz,
    ADD COLUMN result_received_at   timestamptz,
    ADD COLUMN result_gateway_id    text,
    ADD COLUMN result_session_epoch bigint;


-- command_state is the state a reader shows: a dispatched command with an
-- ack is acknowledged, whichever release's gateway recorded the ack.
-- +goose StatementBegin
CREATE FUNCTION command_state(state text, acked_at timestamptz) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN state = 'dispatched' AND acked_at IS NOT NULL THEN 'acknowledged' ELSE state END
$$;
-- +goose StatementEnd

-- command_results_all is every stored result, with command_results' columns:
-- a filter on command_id reaches both branches' indexes (the primary key of
-- commands, command_results_one_per_command).
CREATE VIEW command_results_all AS
SELECT node_id, result_id AS id, id AS command_id, result_exit_code AS exit_code,
       coalesce(result_output, ''::bytea) AS output, coalesce(result_error, '') AS error,
       result_started_at AS started_at, result_finished_at AS finished_at,
       result_received_at AS received_at, result_gateway_id AS gateway_id,
       result_session_epoch AS session_epoch
  FROM commands WHERE result_id IS NOT NULL
UNION ALL
SELECT node_id, id, command_id, exit_code, output, error, started_at, finished_at,
       received_at, gateway_id, session_epoch
  FROM command_results;

-- +goose Down
DROP VIEW command_results_all;
DROP FUNCTION command_state(text, timestamptz);
ALTER TABLE commands
    DROP COLUMN result_id,
    DROP COLUMN result_exit_code,
    DROP COLUMN result_output,
    DROP COLUMN result_error,
    DROP COLUMN result_started_at,
    DROP COLUMN result_finished_at,
    DROP COLUMN result_received_at,
    DROP COLUMN result_gateway_id,
    DROP COLUMN result_session_epoch;
