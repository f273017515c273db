-- +goose Up
-- No NOTIFY per command insert (docs/decisions.md, "Throughput"). The trigger of 00008 made every
-- inserting commit take PostgreSQL's global notify lock, which serialised
-- them. The process that creates commands now wakes the gateways itself,
-- after its commit, with coalesced notifications (pkg/cmdwake: at most one
-- NOTIFY per few milliseconds naming every node that got a command); the
-- gateways' dispatch poll stays the fallback for creators that do not.
DROP TRIGGER commands_notify_insert ON commands;
DROP FUNCTION commands_notify();

-- +goose Down
-- +goose StatementBegin
CREATE FUNCTION commands_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('leasehold_commands', NEW.node_id);
    RETURN NULL;
END $$;
-- +goose StatementEnd

CREATE TRIGGER commands_notify_insert AFTER INSERT ON commands
    FOR EACH ROW EXECUTE FUNCTION commands_notify();
