package gateway

// The gateway's statements, one per purpose, always parameterised. Every
// time comes from compute_now().

// helloSessionSQL routes the node here and bumps its session epoch.
const helloSessionSQL = `
INSERT INTO node_sessions AS s (node_id, gateway_id, session_epoch, state, connected_at, last_seen_at, session_expires_at)
VALUES ($1, $2, 1, 'connected', compute_now(), compute_now(), compute_now() + make_interval(secs => $3::float8))
ON CONFLICT (node_id) DO UPDATE SET
  gateway_id = EXCLUDED.gateway_id,
  session_epoch = s.session_epoch + 1,
  state = 'connected',
  connected_at = EXCLUDED.connected_at,
  last_seen_at = EXCLUDED.last_seen_at,
  session_expires_at = EXCLUDED.session_expires_at,
  closed_at = NULL,
  close_reason = NULL
RETURNING session_epoch`

// helloNodeSQL marks the node connected at the new epoch and reads its spec.
const helloNodeSQL = `
UPDATE nodes SET state = 'connected', state_epoch = $2, daemon_version = $3, labels = $4, updated_at = compute_now()
 WHERE id = $1 AND state <> 'revoked'
RETURNING spec, spec_version`

// newerSpecsSQL returns the specs of the given sessions' nodes that are
// newer than the version each node last received.
const newerSpecsSQL = `
SELECT n.id, n.spec_version, n.spec
  FROM unnest($1::text[], $2::bigint[]) AS m(node_id, version)
  JOIN nodes n ON n.id = m.node_id
 WHERE n.spec_version > m.version`

// discoveryVouchSQL checks, for a site agent's discovery report, that the
// agent holds its site's boot lease at the report's epoch. FOR SHARE makes a
// takeover of the lease wait until the report is stored, so a report is
// stored only while its epoch is current.
const discoveryVouchSQL = `
SELECT l.epoch
  FROM nodes n
  JOIN leases l ON l.name = 'site:' || n.site_id || ':boot'
 WHERE n.id = $1 AND n.kind = 'site_agent'
   AND l.owner = $1 AND l.epoch = $2 AND l.expires_at > compute_now()
   FOR SHARE OF l`

// helloReplaySQL takes the node's in-flight commands for replay: dispatched
// or acknowledged without a result, plus pending ones the daemon names as
// journalled.
const helloReplaySQL = `
UPDATE commands SET
  state = CASE WHEN state = 'pending' THEN 'dispatched' ELSE state END,
  dispatch_count = dispatch_count + 1,
  dispatched_at = compute_now(),
  dispatched_by = $3,
  dispatch_epoch = $4
 WHERE node_id = $1
   AND (state IN ('dispatched', 'acknowledged') OR (state = 'pending' AND id = ANY($2::text[])))
RETURNING id, kind, payload, deadline, dispatch_count, created_at`

// dispatchSQL takes pending commands of nodes whose session this gateway
// holds at the given epochs: the route is the join on node_sessions at
// dispatch time, and SKIP LOCKED lets gateways dispatch side by side.
const dispatchSQL = `
WITH mine AS (
  SELECT * FROM unnest($2::text[], $3::bigint[]) AS m(node_id, epoch)
), picked AS (
  SELECT c.id
    FROM commands c
    JOIN node_sessions s ON s.node_id = c.node_id
    JOIN mine m ON m.node_id = s.node_id AND m.epoch = s.session_epoch
   WHERE c.state = 'pending' AND s.gateway_id = $1
     AND (c.deadline IS NULL OR c.deadline > compute_now())
   ORDER BY c.created_at
   LIMIT $4
   FOR UPDATE OF c SKIP LOCKED
)
UPDATE commands c SET
  state = 'dispatched',
  dispatch_count = c.dispatch_count + 1,
  dispatched_at = compute_now(),
  dispatched_by = $1,
  dispatch_epoch = s.session_epoch
  FROM picked, node_sessions s
 WHERE c.id = picked.id AND s.node_id = c.node_id
RETURNING c.id, c.node_id, s.session_epoch, c.kind, c.payload, c.deadline, c.dispatch_count,
          extract(epoch FROM compute_now() - c.created_at)::float8, c.traceparent`

// livenessSQL extends every session this gateway holds at its epoch; the
// sessions it does not return are zombies.
const livenessSQL = `
UPDATE node_sessions s SET
  last_seen_at = compute_now(),
  session_expires_at = compute_now() + make_interval(secs => $4::float8)
  FROM unnest($2::text[], $3::bigint[]) AS m(node_id, epoch)
 WHERE s.node_id = m.node_id AND s.session_epoch = m.epoch AND s.gateway_id = $1 AND s.state = 'connected'
RETURNING s.node_id`

// closeSessionSQL marks a session whose stream ended disconnected, only at
// its epoch; closeNodeSQL does the same for the node's state.
const closeSessionSQL = `
UPDATE node_sessions SET state = 'disconnected', closed_at = compute_now(), last_seen_at = compute_now()
 WHERE node_id = $1 AND session_epoch = $2 AND gateway_id = $3 AND state = 'connected'`

const closeNodeSQL = `
UPDATE nodes SET state = 'disconnected', updated_at = compute_now()
 WHERE id = $1 AND state_epoch = $2 AND state = 'connected'`

// ackSQL records a command acknowledgement from its own node.
const ackSQL = `
UPDATE commands SET state = 'acknowledged', acked_at = compute_now()
 WHERE id = $1 AND node_id = $2 AND state = 'dispatched'`

const commandOwnerSQL = `SELECT node_id, state FROM commands WHERE id = $1`

const commandOwnerForUpdateSQL = `SELECT node_id, state, traceparent FROM commands WHERE id = $1 FOR UPDATE`

const insertResultSQL = `
INSERT INTO command_results (node_id, id, command_id, exit_code, output, error, started_at, finished_at, gateway_id, session_epoch)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
ON CONFLICT (node_id, id) DO NOTHING`

const finishCommandSQL = `
UPDATE commands SET state = $2, finished_at = compute_now()
 WHERE id = $1 AND state IN ('pending', 'dispatched', 'acknowledged')`

const insertEventSQL = `
INSERT INTO node_events (node_id, id, kind, payload, occurred_at, gateway_id, session_epoch, boot_epoch)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
ON CONFLICT (node_id, id) DO NOTHING`

// commandsChannel is the NOTIFY channel of command inserts (migration 00008).
const commandsChannel = "leasehold_commands"

// specChannel is the NOTIFY channel of node spec changes (migration 00013).
const specChannel = "leasehold_node_spec"

// DiscoveryEventKind is the event kind of a site agent's discovery report;
// it is stored only when its boot_epoch is the agent's current boot epoch.
const DiscoveryEventKind = "discovery"
