package gateway

import (
	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/pgnotify"
)

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
// agent holds its site's boot lease at the report's epoch: pkg/coord's fence
// of the boot lease (FOR KEY SHARE, as every fence), which makes a takeover
// of the lease wait until the report is stored, so a report is stored only
// while its epoch is current. $1 is the agent's node id, $2 the epoch.
const discoveryVouchSQL = coord.FenceSiteBootSQL

// helloReplaySQL takes the node's in-flight commands for replay: dispatched
// or acknowledged without a result, plus pending ones the daemon names as
// journalled. It locks them in id order first, so two transactions that
// both lock a node's commands in order cannot deadlock each other; a
// deadlock with a group commit (which locks in its batch's order) aborts
// one of them, and the group commit writes its batch again (ingest.go).
// It waits for a row another transaction holds rather than skipping it: a
// skipped command acknowledged but not replayed could wait for the node's
// next Hello before its result is sent again.
const helloReplaySQL = `
WITH replay AS (
  SELECT id FROM commands
   WHERE node_id = $1
     AND (state IN ('dispatched', 'acknowledged') OR (state = 'pending' AND id = ANY($2::text[])))
   ORDER BY id
   FOR UPDATE
)
UPDATE commands c SET
  state = CASE WHEN c.state = 'pending' THEN 'dispatched' ELSE c.state END,
  dispatch_count = c.dispatch_count + 1,
  dispatched_at = compute_now(),
  dispatched_by = $3,
  dispatch_epoch = $4
  FROM replay
 WHERE c.id = replay.id
RETURNING c.id, c.kind, c.payload, c.deadline, c.dispatch_count, c.created_at`

// dispatchSQL takes pending commands of nodes whose session this gateway
// holds at the given epochs: the route is the join on node_sessions at
// dispatch time, and SKIP LOCKED lets gateways dispatch side by side.
//
// Its cost follows the batch, not the backlog: for each session a LATERAL
// pick reads at most that node's limit ($4[i]) of its oldest pending
// commands from commands_pending_idx (node_id, created_at) WHERE state =
// 'pending', already in order, so nothing is sorted but the picked rows.
// A plan that joins every pending command and sorts it all (what this
// replaced) costs 25-32 ms at 30,000 pending; TestDispatchPlanIsOBatch
// holds the plan to the batch with EXPLAIN (ANALYZE, BUFFERS).
const dispatchSQL = `
WITH mine AS (
  SELECT * FROM unnest($2::text[], $3::bigint[], $4::int[]) AS m(node_id, epoch, lim)
), picked AS (
  SELECT p.id
    FROM mine m
    JOIN node_sessions s ON s.node_id = m.node_id AND s.session_epoch = m.epoch AND s.gateway_id = $1
    CROSS JOIN LATERAL (
      SELECT c.id, c.created_at
        FROM commands c
       WHERE c.node_id = m.node_id AND c.state = 'pending'
         AND (c.deadline IS NULL OR c.deadline > compute_now())
       ORDER BY c.created_at
       LIMIT m.lim
       FOR UPDATE SKIP LOCKED
    ) p
   ORDER BY p.created_at
   LIMIT $5
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

// livenessSQL extends every session this gateway holds at its epoch and
// records each node's clock skew measured since (NULL keeps the last); the
// sessions it does not return are zombies.
const livenessSQL = `
UPDATE node_sessions s SET
  last_seen_at = compute_now(),
  session_expires_at = compute_now() + make_interval(secs => $4::float8),
  clock_skew_ms = coalesce(m.skew, s.clock_skew_ms)
  FROM unnest($2::text[], $3::bigint[], $5::int[]) AS m(node_id, epoch, skew)
 WHERE s.node_id = m.node_id AND s.session_epoch = m.epoch AND s.gateway_id = $1 AND s.state = 'connected'
RETURNING s.node_id, compute_now()`

// closeSessionSQL marks a session whose stream ended disconnected, only at
// its epoch; closeNodeSQL does the same for the node's state.
const closeSessionSQL = `
UPDATE node_sessions SET state = 'disconnected', closed_at = compute_now(), last_seen_at = compute_now()
 WHERE node_id = $1 AND session_epoch = $2 AND gateway_id = $3 AND state = 'connected'`

const closeNodeSQL = `
UPDATE nodes SET state = 'disconnected', updated_at = compute_now()
 WHERE id = $1 AND state_epoch = $2 AND state = 'connected'`

// ingestSQL is the group commit (ingest.go): in one statement it stores a
// batch of results ($2..$11), acks ($12..$14) and events ($15..$22), each
// array element tagged with its item's index, and returns every index with
// its outcome. A result is stored in its command's row (the result_*
// columns) only for a command of its own node and only if the command has
// no result yet, in its row or in command_results, where a gateway of the
// previous release stores them (one result per command, the first: a
// repeat of its id is 'duplicate', another id 'ignored'); the same write
// closes the command as succeeded or failed if it is not terminal. An ack
// sets acked_at on its own node's dispatched command and changes nothing
// any index names, so it is a HOT update; readers show such a command as
// acknowledged (command_state). The batch never holds an ack or a cancel
// ack and a result for the same command, so no row is changed twice.
// Whether a result was stored is an uncorrelated IN over fin, which
// PostgreSQL runs as one hashed subplan: the generic plan guesses ten rows
// for every unnest and CTE, and a join or a correlated EXISTS against fin
// became a nested loop, quadratic in the batch (a batch of 1,000 results
// and 1,000 acks: 182 ms, 156 of them in that loop). When
// a result is stored, one NOTIFY on leasehold_command_done (empty payload,
// once per batch) wakes the api's WaitCommand.
//
// Live output pieces ($23..$28, the cap $29, the truncation flags $34) are
// stored for their own node's commands, cut at the cap, ON CONFLICT DO
// NOTHING on (command_id, offset); a piece the gateway cut at the cap (its
// flag) or reaching past it also stores the command's truncation marker
// (stream 'truncated', at the cap), and a marker-only piece (no data)
// stores just that. One NOTIFY on
// leasehold_command_output per batch names the commands that got output
// (their ids only, "" past 7,900 bytes). Cancel acks ($30..$33) confirm
// the cancellation of their own node's cancelled commands, once.
const ingestSQL = ingestReportsCTEs + ingestOtherCTEs + ingestReportsOutcomes + ingestOtherOutcomes +
	ingestNotifyDone + ingestNotifyOutput

// ingestReportsSQL is ingestSQL for a batch of results and acks only, the
// common batch: the same arms and parameters ($1..$14) without the events,
// output pieces and cancel acks, whose empty CTEs and outcome arms cost
// every call their executor start-up (BenchmarkGroupCommit, 20 results a
// batch: 1.03-1.05 ms against 1.09-1.11 ms with ingestSQL).
const ingestReportsSQL = ingestReportsCTEs + ingestReportsOutcomes + ingestNotifyDone

// The fragments ingestSQL and ingestReportsSQL are made of.
const (
	ingestReportsCTEs = `
WITH r AS (
  SELECT * FROM unnest($2::int[], $3::text[], $4::text[], $5::text[], $6::int[], $7::bytea[], $8::text[],
                       $9::timestamptz[], $10::timestamptz[], $11::bigint[])
    AS r(i, node_id, id, command_id, exit_code, output, error, started_at, finished_at, session_epoch)
), fin AS (
  UPDATE commands c SET
    result_id = r.id, result_exit_code = r.exit_code, result_output = r.output, result_error = r.error,
    result_started_at = r.started_at, result_finished_at = r.finished_at, result_received_at = compute_now(),
    result_gateway_id = $1, result_session_epoch = r.session_epoch,
    state = CASE WHEN c.state NOT IN ('pending', 'dispatched', 'acknowledged') THEN c.state
                 WHEN r.exit_code <> 0 OR r.error <> '' THEN 'failed' ELSE 'succeeded' END,
    finished_at = CASE WHEN c.state IN ('pending', 'dispatched', 'acknowledged') THEN compute_now() ELSE c.finished_at END
    FROM r
   WHERE c.id = r.command_id AND c.node_id = r.node_id AND c.result_id IS NULL
     AND NOT EXISTS (SELECT 1 FROM command_results x WHERE x.command_id = r.command_id)
  RETURNING r.i
), a AS (
  SELECT * FROM unnest($12::int[], $13::text[], $14::text[]) AS a(i, node_id, command_id)
), acked AS (
  UPDATE commands c SET acked_at = compute_now()
    FROM a
   WHERE c.id = a.command_id AND c.node_id = a.node_id AND c.state = 'dispatched' AND c.acked_at IS NULL
  RETURNING c.id
`
	ingestOtherCTEs = `), e AS (
  SELECT * FROM unnest($15::int[], $16::text[], $17::text[], $18::text[], $19::text[], $20::timestamptz[], $21::bigint[], $22::bigint[])
    AS e(i, node_id, id, kind, payload, occurred_at, session_epoch, boot_epoch)
), evins AS (
  INSERT INTO node_events (node_id, id, kind, payload, occurred_at, gateway_id, session_epoch, boot_epoch)
  SELECT e.node_id, e.id, e.kind, e.payload::jsonb, e.occurred_at, $1, e.session_epoch, e.boot_epoch FROM e
  ON CONFLICT (node_id, id) DO NOTHING
  RETURNING node_id, id
), o AS (
  SELECT * FROM unnest($23::int[], $24::text[], $25::text[], $26::bigint[], $27::text[], $28::bytea[], $34::bool[])
    AS o(i, node_id, command_id, off, stream, data, trunc)
), own AS (
  SELECT o.* FROM o JOIN commands c ON c.id = o.command_id AND c.node_id = o.node_id
), oins AS (
  INSERT INTO command_output (command_id, "offset", stream, data)
  SELECT command_id, off, stream, substring(data FROM 1 FOR LEAST(length(data)::bigint, $29::bigint - off)::int)
    FROM own WHERE off < $29::bigint AND length(data) > 0
  ON CONFLICT (command_id, "offset") DO NOTHING
  RETURNING command_id
), omark AS (
  INSERT INTO command_output (command_id, "offset", stream, data)
  SELECT DISTINCT command_id, $29::bigint, 'truncated', ''::bytea FROM own WHERE trunc OR off + length(data) > $29::bigint
  ON CONFLICT (command_id, "offset") DO NOTHING
  RETURNING command_id
), k AS (
  SELECT * FROM unnest($30::int[], $31::text[], $32::text[], $33::text[]) AS k(i, node_id, command_id, outcome)
), kupd AS (
  UPDATE commands c SET cancel_confirmed_at = compute_now(), cancel_outcome = k.outcome
    FROM k
   WHERE c.id = k.command_id AND c.node_id = k.node_id
     AND c.cancel_requested_at IS NOT NULL AND c.cancel_confirmed_at IS NULL
  RETURNING c.id
`
	ingestReportsOutcomes = `)
SELECT r.i, CASE WHEN r.i IN (SELECT i FROM fin) THEN 'stored'
                 WHEN c.id IS NULL THEN 'unknown'
                 WHEN c.node_id <> r.node_id THEN 'denied'
                 WHEN c.result_id = r.id
                   OR EXISTS (SELECT 1 FROM command_results x WHERE x.node_id = r.node_id AND x.id = r.id) THEN 'duplicate'
                 ELSE 'ignored' END,
       CASE WHEN c.node_id = r.node_id THEN c.traceparent END
  FROM r LEFT JOIN commands c ON c.id = r.command_id
UNION ALL
SELECT a.i, CASE WHEN c.node_id IS NOT NULL AND c.node_id <> a.node_id THEN 'denied' ELSE 'ok' END, NULL::text
  FROM a LEFT JOIN commands c ON c.id = a.command_id
`
	ingestOtherOutcomes = `UNION ALL
SELECT e.i, CASE WHEN (e.node_id, e.id) IN (SELECT node_id, id FROM evins) THEN 'stored' ELSE 'duplicate' END, NULL::text
  FROM e
UNION ALL
SELECT o.i, CASE WHEN c.id IS NULL THEN 'unknown'
                 WHEN c.node_id <> o.node_id THEN 'denied'
                 WHEN o.off + length(o.data) > $29::bigint THEN 'capped'
                 ELSE 'ok' END, NULL::text
  FROM o LEFT JOIN commands c ON c.id = o.command_id
UNION ALL
SELECT k.i, CASE WHEN c.node_id IS NOT NULL AND c.node_id <> k.node_id THEN 'denied' ELSE 'ok' END, NULL::text
  FROM k LEFT JOIN commands c ON c.id = k.command_id
`
	ingestNotifyDone = `UNION ALL
SELECT -1, 'notified', NULL::text FROM (SELECT pg_notify('` + pgnotify.CommandDone + `', '') FROM (SELECT 1 FROM fin LIMIT 1) f) n
`
	ingestNotifyOutput = `UNION ALL
SELECT -1, 'notified', NULL::text FROM (
  SELECT pg_notify('` + pgnotify.CommandOutput + `',
                   CASE WHEN sum(length(z.command_id) + 1) <= 7900 THEN string_agg(z.command_id, ',') ELSE '' END)
    FROM (SELECT command_id FROM oins UNION SELECT command_id FROM omark) z
  HAVING count(*) > 0) n2`
)

const insertEventSQL = `
INSERT INTO node_events (node_id, id, kind, payload, occurred_at, gateway_id, session_epoch, boot_epoch)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
ON CONFLICT (node_id, id) DO NOTHING`

// DiscoveryEventKind is the event kind of a site agent's discovery report;
// it is stored only when its boot_epoch is the agent's current boot epoch.
const DiscoveryEventKind = "discovery"

// failUndeliverableSQL fails commands this gateway dispatched but cannot
// send (their message exceeds --gateway.max-message-bytes), fenced like
// dispatch: only at the dispatch this gateway made at that session epoch,
// and only while the command is in flight (so it has no result). The
// reason is stored as the command's result (result id
// "undeliverable/<command id>"), and one NOTIFY wakes the api's
// WaitCommand.
const failUndeliverableSQL = `
WITH x AS (
  SELECT * FROM unnest($2::text[], $3::text[], $4::bigint[], $5::text[]) AS x(id, node_id, epoch, reason)
), f AS (
  UPDATE commands c SET state = 'failed', finished_at = compute_now(),
         result_id = left('undeliverable/' || c.id, 200), result_exit_code = -1, result_error = x.reason,
         result_received_at = compute_now(), result_gateway_id = $1, result_session_epoch = x.epoch
    FROM x
   WHERE c.id = x.id AND c.node_id = x.node_id AND c.dispatched_by = $1 AND c.dispatch_epoch = x.epoch
     AND c.state IN ('dispatched', 'acknowledged') AND c.result_id IS NULL
  RETURNING c.id
)
SELECT count(*) FROM f, LATERAL (SELECT pg_notify('` + pgnotify.CommandDone + `', '')) n`

// failRefusedResultSQL fails a command whose node's result the database
// refused for good (ingest.go, permanentDBError): only the node's own
// command, only while it is not terminal; the refusal is stored as its
// result (result id "refused/<command id>") and one NOTIFY wakes the api's
// WaitCommand.
const failRefusedResultSQL = `
WITH f AS (
  UPDATE commands SET state = 'failed', finished_at = compute_now(),
         result_id = left('refused/' || id, 200), result_exit_code = -1, result_error = $3,
         result_received_at = compute_now(), result_gateway_id = $4, result_session_epoch = $5
   WHERE id = $2 AND node_id = $1 AND state IN ('pending', 'dispatched', 'acknowledged') AND result_id IS NULL
  RETURNING id
)
SELECT count(*) FROM f, LATERAL (SELECT pg_notify('` + pgnotify.CommandDone + `', '')) n`
