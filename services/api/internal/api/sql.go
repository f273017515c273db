package api

import (
	"github.com/leasehold/leasehold/pkg/cmdstore"
	"github.com/leasehold/leasehold/pkg/nodereg"
)

// ControlService's statements, one per purpose, always parameterised. Every
// time comparison uses compute_now().

// nodeSelect reads nodes with their session. Labels are those the node
// reports, overlaid by those the control plane assigns (spec.labels).
const nodeSelect = `
SELECT n.id, n.kind, coalesce(n.site_id, ''),
       CASE WHEN jsonb_typeof(n.labels) = 'object' THEN n.labels ELSE '{}'::jsonb END
         || CASE WHEN jsonb_typeof(n.spec->'labels') = 'object' THEN n.spec->'labels' ELSE '{}'::jsonb END,
       coalesce(n.pool_id, ''), n.state, coalesce(s.session_epoch, 0),
       CASE WHEN s.state = 'connected' THEN s.gateway_id ELSE '' END,
       n.daemon_version, s.last_seen_at, n.created_at,
       CASE WHEN n.state = 'revoked' THEN n.updated_at END, n.cordoned_at
  FROM nodes n LEFT JOIN node_sessions s ON s.node_id = n.id`

const getNodeSQL = nodeSelect + ` WHERE n.id = $1`

const listNodesSQL = nodeSelect + `
 WHERE n.id > $1 AND ($2 = '' OR n.state = $2) AND ($3 = '' OR n.pool_id = $3)
   AND (NOT $5 OR n.cordoned_at IS NOT NULL)
 ORDER BY n.id LIMIT $4`

// lockPoolSQL checks that a pool exists and keeps it from being deleted
// until the transaction ends.
const lockPoolSQL = `SELECT 1 FROM pools WHERE id = $1 FOR KEY SHARE`

// insertNodeSQL creates a node: $5 is its spec (assigned labels), $6 the
// labels it reports about itself (Hello replaces them).
const insertNodeSQL = `
INSERT INTO nodes (id, kind, site_id, pool_id, spec, labels) VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb)
ON CONFLICT (id) DO NOTHING`

const insertCredentialSQL = `INSERT INTO node_credentials (node_id, credential_hash) VALUES ($1, $2)`

const lockNodeForRevokeSQL = `SELECT state FROM nodes WHERE id = $1 FOR UPDATE`

// revokeCredentialsSQL revokes every live credential of the node now, those
// in a rotation's grace (revoked_at in the future) included.
const revokeCredentialsSQL = nodereg.RevokeLiveSQL

const revokeNodeSQL = `UPDATE nodes SET state = 'revoked', updated_at = compute_now() WHERE id = $1`

// closeRevokedSessionSQL closes the node's session: the gateway's next
// liveness write matches no row, so it sees a zombie and closes the stream;
// the daemon's next Hello fails authentication.
const closeRevokedSessionSQL = `
UPDATE node_sessions SET state = 'disconnected', closed_at = compute_now()
 WHERE node_id = $1 AND state = 'connected'`

// commandColumns are a command's columns as scanCommand reads them; its
// state is command_state's (a dispatched command with an ack is
// acknowledged); updated_at is the latest of its transitions. The stored live output's
// size and truncation come from the command's last command_output row (an
// index probe on its primary key).
const commandColumns = `id, node_id, kind, payload, command_state(state, acked_at), deadline, coalesce(idempotency_key, ''), dispatch_count,
       created_at, GREATEST(created_at, dispatched_at, acked_at, finished_at),
       cancel_requested_at, cancel_confirmed_at IS NOT NULL, coalesce(cancel_outcome, ''),
       coalesce((SELECT o."offset" + length(o.data) FROM command_output o WHERE o.command_id = id ORDER BY o."offset" DESC LIMIT 1), 0),
       coalesce((SELECT o.stream = 'truncated' FROM command_output o WHERE o.command_id = id ORDER BY o."offset" DESC LIMIT 1), false)`

const commandSelect = `
SELECT ` + commandColumns + `
  FROM commands`

const commandReturning = `
RETURNING ` + commandColumns

const getCommandSQL = commandSelect + ` WHERE id = $1`

const commandByKeySQL = commandSelect + ` WHERE node_id = $1 AND idempotency_key = $2`

const listCommandsSQL = commandSelect + `
 WHERE ($1::timestamptz IS NULL OR (created_at, id) < ($1, $2))
   AND ($3 = '' OR node_id = $3) AND ($4 = '' OR command_state(state, acked_at) = $4)
 ORDER BY created_at DESC, id DESC LIMIT $5`

// lockNodeForCommandSQL and insertCommandSQL are pkg/cmdstore's, the one
// owner of "insert a command" (the worker's runs reconciler inserts through
// it too): the node check, then the insert returning what scanCommand reads.
const lockNodeForCommandSQL = cmdstore.LockNodeSQL

const insertCommandSQL = cmdstore.InsertSQL + commandReturning

// cancelCommandSQL cancels a command that has not finished; one already
// given to its node (dispatched or acknowledged) also gets
// cancel_requested_at, which the node's gateway delivers as CancelCommand.
const cancelCommandSQL = `
UPDATE commands SET state = 'cancelled', finished_at = compute_now(),
       cancel_requested_at = CASE WHEN state IN ('dispatched', 'acknowledged') THEN compute_now() END
 WHERE id = $1 AND state IN ('pending', 'dispatched', 'acknowledged')` + commandReturning

// resultSQL reads a command's result, from its row or from command_results
// (where a gateway of the previous release stores it): the first stored,
// should there be more than one.
const resultSQL = `
SELECT command_id, id, exit_code, output, error, started_at, finished_at, received_at
  FROM command_results_all WHERE command_id = $1
 ORDER BY received_at, id LIMIT 1`

// finishedCommandsSQL is the wait hub's poll.
const finishedCommandsSQL = `
SELECT id FROM commands WHERE id = ANY($1::text[])
   AND state IN ('succeeded', 'failed', 'cancelled', 'expired')`

const poolSelect = `
SELECT p.id, p.description, p.labels,
       (SELECT count(*) FROM nodes n WHERE n.pool_id = p.id AND n.state <> 'revoked'),
       p.created_at
  FROM pools p`

const getPoolSQL = poolSelect + ` WHERE p.id = $1`

const listPoolsSQL = poolSelect + ` WHERE p.id > $1 ORDER BY p.id LIMIT $2`

const insertPoolSQL = `
INSERT INTO pools (id, description, labels) VALUES ($1, $2, $3::jsonb)
ON CONFLICT (id) DO NOTHING RETURNING id`

const poolLeaseSelect = `
SELECT l.id, l.pool_id, l.tenant, l.count, l.selector, l.state, l.created_at,
       GREATEST(l.created_at, l.allocated_at, l.released_at), l.released_at,
       coalesce((SELECT array_agg(a.node_id ORDER BY a.node_id) FROM node_allocations a
                  WHERE a.pool_lease_id = l.id), '{}')
  FROM pool_leases l`

const getPoolLeaseSQL = poolLeaseSelect + ` WHERE l.id = $1`

const listPoolLeasesSQL = poolLeaseSelect + `
 WHERE ($1::timestamptz IS NULL OR (l.created_at, l.id) < ($1, $2))
   AND ($3 = '' OR l.pool_id = $3) AND ($4 = '' OR l.tenant = $4) AND ($5 = '' OR l.state = $5)
 ORDER BY l.created_at DESC, l.id DESC LIMIT $6`

const insertPoolLeaseSQL = `
INSERT INTO pool_leases (pool_id, tenant, count, selector) VALUES ($1, $2, $3, $4::jsonb) RETURNING id`

// lockPoolLeaseSQL serialises a release with the placer, which must lock the
// pending lease (FOR UPDATE) in its fenced transaction before allocating.
const lockPoolLeaseSQL = `SELECT pool_id, state FROM pool_leases WHERE id = $1 FOR UPDATE`

const releasePoolLeaseSQL = `
UPDATE pool_leases SET state = 'released', released_at = compute_now() WHERE id = $1`

const deleteAllocationsSQL = `DELETE FROM node_allocations WHERE pool_lease_id = $1`

const sinkSelect = `SELECT id, kind, url, secret <> '', created_at FROM sinks`

const insertSinkSQL = `
INSERT INTO sinks (id, kind, url, secret) VALUES ($1, $2, $3, $4)
ON CONFLICT (id) DO NOTHING RETURNING id, kind, url, secret <> '', created_at`

const listSinksSQL = sinkSelect + ` ORDER BY id LIMIT 10000`

// deleteSinkSQL deletes the sink and its cursor: a sink created again
// under the same id starts afresh.
const deleteSinkSQL = `
WITH gone AS (DELETE FROM sinks WHERE id = $1 RETURNING id)
, cur AS (DELETE FROM sink_cursors WHERE sink_id IN (SELECT id FROM gone))
SELECT count(*) FROM gone`

const listLeasesSQL = `
SELECT name, coalesce(owner, ''), epoch, expires_at, expires_at <= compute_now()
  FROM leases
 WHERE starts_with(name, $1) AND name > $2
 ORDER BY name LIMIT $3`

// liveWorkerWindow is docs/design.md#membership's live worker window.
const listWorkersSQL = `
SELECT id, member_group, heartbeat_at, clock_skew_ms, heartbeat_at > compute_now() - interval '30 seconds'
  FROM workers
 WHERE ($1 = '' OR member_group = $1)
 ORDER BY member_group, id LIMIT 10000`

// listGatewaysSQL joins gateway:<id> leases with the sessions routed to
// each gateway; a gateway with connected sessions but no lease row (it
// never took one, or the row was removed) is listed too, not live.
const listGatewaysSQL = `
WITH g AS (
  SELECT substr(name, length('gateway:') + 1) AS id, epoch, expires_at,
         owner IS NOT NULL AND expires_at > compute_now() AS live
    FROM leases WHERE starts_with(name, 'gateway:')
), s AS (
  SELECT gateway_id AS id, count(*) FILTER (WHERE state = 'connected') AS sessions
    FROM node_sessions GROUP BY gateway_id
)
SELECT coalesce(g.id, s.id), coalesce(g.epoch, 0), g.expires_at, coalesce(g.live, false), coalesce(s.sessions, 0)
  FROM g FULL JOIN s ON s.id = g.id
 WHERE g.id IS NOT NULL OR s.sessions > 0
 ORDER BY 1 LIMIT 10000`

// lockNodeForCordonSQL takes the row lock the placer takes on a candidate
// (FOR NO KEY UPDATE): a cordon waits for a placement of the node in
// flight and a placement skips a node being cordoned.
const lockNodeForCordonSQL = `SELECT cordoned_at IS NOT NULL FROM nodes WHERE id = $1 FOR NO KEY UPDATE`

const cordonNodeSQL = `UPDATE nodes SET cordoned_at = compute_now() WHERE id = $1 AND cordoned_at IS NULL`

const uncordonNodeSQL = `UPDATE nodes SET cordoned_at = NULL WHERE id = $1 AND cordoned_at IS NOT NULL`

// nodeWorkSQL lists what keeps a node from being drained: its dispatched
// and running commands and the pool leases it is allocated to.
const nodeWorkSQL = `
SELECT coalesce((SELECT array_agg(id ORDER BY id) FROM (
          SELECT id FROM commands WHERE node_id = $1 AND state IN ('dispatched', 'acknowledged')
           ORDER BY id LIMIT 1000) c), '{}'),
       coalesce((SELECT array_agg(pool_lease_id ORDER BY pool_lease_id) FROM node_allocations WHERE node_id = $1), '{}')`
