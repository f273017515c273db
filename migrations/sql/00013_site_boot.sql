-- +goose Up
-- Site boot (docs/design.md#site-agents) and NodeSpecUpdate delivery.
--
-- nodes.spec_version rises on every change of spec, so a gateway knows which
-- spec each of its sessions last received and pushes NodeSpecUpdate only for
-- newer ones; a change also NOTIFYs 'leasehold_node_spec' with the node id so
-- the push happens at once. Gateways still poll spec_version when
-- notifications are unavailable (PgBouncer transaction mode).
ALTER TABLE nodes ADD COLUMN spec_version bigint NOT NULL DEFAULT 0;

-- +goose StatementBegin
CREATE FUNCTION nodes_spec_version() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.spec IS DISTINCT FROM OLD.spec THEN
        NEW.spec_version := OLD.spec_version + 1;
    END IF;
    RETURN NEW;
END $$;
-- +goose StatementEnd

CREATE TRIGGER nodes_spec_version BEFORE UPDATE OF spec ON nodes
    FOR EACH ROW EXECUTE FUNCTION nodes_spec_version();

-- The channel name must match pgnotify.NodeSpec (pkg/pgnotify/channels.go;
-- TestChannelsMatchMigrations checks it).
-- +goose StatementBegin
CREATE FUNCTION nodes_spec_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('leasehold_node_spec', NEW.id);
    RETURN NULL;
END $$;
-- +goose StatementEnd

CREATE TRIGGER nodes_spec_notify AFTER UPDATE OF spec ON nodes
    FOR EACH ROW WHEN (OLD.spec IS DISTINCT FROM NEW.spec)
    EXECUTE FUNCTION nodes_spec_notify();

-- The site reconciler looks up the agents of a site by kind and site.
CREATE INDEX nodes_site_agents_idx ON nodes (site_id, id) WHERE kind = 'site_agent';

-- +goose Down
DROP INDEX nodes_site_agents_idx;
DROP TRIGGER nodes_spec_notify ON nodes;
DROP FUNCTION nodes_spec_notify();
DROP TRIGGER nodes_spec_version ON nodes;
DROP FUNCTION nodes_spec_version();
ALTER TABLE nodes DROP COLUMN spec_version;
