package api

// Runs (docs/api.md, "Runs"): one command on many nodes. The api resolves
// the target and writes the run with its nodes in one transaction; the
// workers' runs reconciler (services/worker/internal/runs) starts and
// follows the nodes' commands.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/queue"
	"github.com/leasehold/leasehold/pkg/selector"
)

// RunsReconciler is the work-queue reconciler of the workers' runs
// reconciler; its keys are run ids.
const RunsReconciler = "runs"

// Run limits and defaults.
const (
	// DefaultMaxInFlight is max_in_flight when unset.
	DefaultMaxInFlight = 50
	// maxRunCount bounds a numeric max_in_flight or max_failures.
	maxRunCount = 100000
	// maxRunNodeIDs bounds target.node_ids.
	maxRunNodeIDs = 10000
	// maxRunBatchPause bounds batch_pause.
	maxRunBatchPause = time.Hour
	// maxRunDescription is the most bytes of a run's description.
	maxRunDescription = 200
	// maxRunReason is the most characters of CancelRun's reason.
	maxRunReason = 200
)

var (
	runStates = map[string]controlv1.RunState{
		"running": controlv1.RunState_RUN_STATE_RUNNING, "succeeded": controlv1.RunState_RUN_STATE_SUCCEEDED,
		"failed": controlv1.RunState_RUN_STATE_FAILED, "cancelled": controlv1.RunState_RUN_STATE_CANCELLED,
	}
	runNodeStates = map[string]controlv1.RunNodeState{
		"pending": controlv1.RunNodeState_RUN_NODE_STATE_PENDING, "running": controlv1.RunNodeState_RUN_NODE_STATE_RUNNING,
		"succeeded": controlv1.RunNodeState_RUN_NODE_STATE_SUCCEEDED, "failed": controlv1.RunNodeState_RUN_NODE_STATE_FAILED,
		"unreachable": controlv1.RunNodeState_RUN_NODE_STATE_UNREACHABLE, "skipped": controlv1.RunNodeState_RUN_NODE_STATE_SKIPPED,
		"not_started": controlv1.RunNodeState_RUN_NODE_STATE_NOT_STARTED, "cancelled": controlv1.RunNodeState_RUN_NODE_STATE_CANCELLED,
	}
)

// runCount is a parsed max_in_flight or max_failures: a number, or a
// percentage of the run's nodes.
type runCount struct {
	n   int
	pct bool
}

// resolve turns the count into a number of nodes out of total: a
// percentage rounds up (ceil) or down.
func (c runCount) resolve(total int, ceil bool) int {
	if !c.pct {
		return c.n
	}
	if ceil {
		return (c.n*total + 99) / 100
	}
	return c.n * total / 100
}

// parseRunCount parses "N" or "N%"; zero is refused unless allowZero,
// more than 100% always.
func parseRunCount(field, s string, allowZero bool) (runCount, error) {
	num, pct := strings.CutSuffix(s, "%")
	n, err := strconv.Atoi(num)
	if err != nil || n < 0 || num == "" || num[0] == '+' || num[0] == '-' {
		return runCount{}, invalid(field, "must be a number or a percentage (\"10\", \"25%%\"), got %q", abbrev(s))
	}
	if n == 0 && !allowZero {
		return runCount{}, invalid(field, "must be at least 1 or 1%%, got %q", s)
	}
	if pct && n > 100 {
		return runCount{}, invalid(field, "must be at most 100%%, got %q", s)
	}
	if !pct && n > maxRunCount {
		return runCount{}, invalid(field, "must be at most %d, got %q", maxRunCount, s)
	}
	return runCount{n: n, pct: pct}, nil
}

// createRun is a validated CreateRunRequest.
type createRun struct {
	nodeIDs     []string
	sel         selector.Selector
	selText     string
	poolID      string
	timeout     time.Duration
	inFlight    runCount
	failures    runCount
	batchPause  time.Duration
	key         *string
	description string
}

func validateCreateRun(m *controlv1.CreateRunRequest, defaultTimeout time.Duration, maxPayload int) (createRun, error) {
	var c createRun
	t := m.GetTarget()
	if len(t.GetNodeIds()) == 0 && strings.TrimSpace(t.GetSelector()) == "" && t.GetPoolId() == "" {
		return c, invalid("target", "is required: give node_ids, a selector or a pool_id")
	}
	if len(t.GetNodeIds()) > maxRunNodeIDs {
		return c, invalid("target.node_ids", "has %d entries, more than %d", len(t.GetNodeIds()), maxRunNodeIDs)
	}
	seen := make(map[string]bool, len(t.GetNodeIds()))
	for i, id := range t.GetNodeIds() {
		if err := checkRE(fmt.Sprintf("target.node_ids[%d]", i), id, idRE); err != nil {
			return c, err
		}
		if !seen[id] {
			seen[id] = true
			c.nodeIDs = append(c.nodeIDs, id)
		}
	}
	sel, err := selector.Parse(t.GetSelector())
	if err != nil {
		return c, invalid("target.selector", "%v", err)
	}
	c.sel, c.selText = sel, t.GetSelector() // stored as given
	if err := checkOptionalRE("target.pool_id", t.GetPoolId(), idRE); err != nil {
		return c, err
	}
	c.poolID = t.GetPoolId()
	if err := checkKindPayloadSize(m.GetKind(), m.GetPayload(), maxPayload); err != nil {
		return c, err
	}
	c.timeout = defaultTimeout
	if m.GetCommandTimeout() != nil {
		if c.timeout, err = checkDuration("command_timeout", m.GetCommandTimeout(), MinCommandTimeout, MaxCommandTimeout); err != nil {
			return c, err
		}
	}
	c.inFlight = runCount{n: DefaultMaxInFlight}
	if s := m.GetMaxInFlight(); s != "" {
		if c.inFlight, err = parseRunCount("max_in_flight", s, false); err != nil {
			return c, err
		}
	}
	if s := m.GetMaxFailures(); s != "" {
		if c.failures, err = parseRunCount("max_failures", s, true); err != nil {
			return c, err
		}
	}
	if m.GetBatchPause() != nil {
		if c.batchPause, err = checkDuration("batch_pause", m.GetBatchPause(), 0, maxRunBatchPause); err != nil {
			return c, err
		}
	}
	if k := m.GetIdempotencyKey(); k != "" {
		if err := checkRE("idempotency_key", k, idempotencyKeyRE); err != nil {
			return c, err
		}
		c.key = &k
	}
	if len(m.GetDescription()) > maxRunDescription {
		return c, invalid("description", "must be at most %d bytes, got %d", maxRunDescription, len(m.GetDescription()))
	}
	if err := checkText("description", m.GetDescription(), maxRunDescription); err != nil {
		return c, err
	}
	c.description = m.GetDescription()
	// As in CreateCommand, a typed kind's payload is parsed last.
	if err := checkPayload(m.GetKind(), m.GetPayload()); err != nil {
		return c, err
	}
	return c, nil
}

// effectiveLabels is a node's labels as nodeSelect shows them: reported,
// overlaid by assigned.
const effectiveLabels = `(CASE WHEN jsonb_typeof(n.labels) = 'object' THEN n.labels ELSE '{}'::jsonb END
  || CASE WHEN jsonb_typeof(n.spec->'labels') = 'object' THEN n.spec->'labels' ELSE '{}'::jsonb END)`

// resolveRunNodesSQL is a run's node set: nodes (not site agents) not
// revoked, named in $1 (when any), of pool $2 (when set), matching the
// selector $3; cordoned ones (DrainNode and DecommissionNode cordon too)
// are marked so.
var resolveRunNodesSQL = `
SELECT n.id, n.cordoned_at IS NOT NULL
  FROM nodes n
 WHERE n.state <> 'revoked' AND n.kind = 'node'
   AND (coalesce(cardinality($1::text[]), 0) = 0 OR n.id = ANY ($1::text[]))
   AND ($2 = '' OR n.pool_id = $2)
   AND ` + selector.SQLCondition(effectiveLabels, "$3") + `
 ORDER BY n.id`

const missingNodesSQL = `
SELECT id FROM unnest($1::text[]) AS t(id) WHERE NOT EXISTS (SELECT 1 FROM nodes n WHERE n.id = t.id) ORDER BY id LIMIT 1`

const insertRunSQL = `
INSERT INTO runs (target, kind, payload, command_timeout, max_in_flight, max_failures, batch_pause,
                  idempotency_key, description, created_by)
VALUES ($1::jsonb, $2, $3, make_interval(secs => $4::float8), $5, $6, make_interval(secs => $7::float8), $8, $9, $10)
ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING id`

const insertRunNodesSQL = `
INSERT INTO run_nodes (run_id, node_id, state, error)
SELECT $1, t.node_id, t.state, t.error FROM unnest($2::text[], $3::text[], $4::text[]) AS t(node_id, state, error)`

const runSelect = `
SELECT r.id, r.target, r.kind, r.payload, (extract(epoch FROM r.command_timeout) * 1000)::bigint,
       r.max_in_flight, r.max_failures, (extract(epoch FROM r.batch_pause) * 1000)::bigint,
       r.state, r.reason, coalesce(r.idempotency_key, ''), r.description, r.created_at, r.finished_at,
       coalesce((SELECT jsonb_object_agg(c.state, c.n) FROM (
                   SELECT state, count(*) AS n FROM run_nodes WHERE run_id = r.id GROUP BY state) c), '{}'::jsonb)
  FROM runs r`

const getRunSQL = runSelect + ` WHERE r.id = $1`

const runByKeySQL = runSelect + ` WHERE r.idempotency_key = $1`

const listRunsSQL = runSelect + `
 WHERE ($1::timestamptz IS NULL OR (r.created_at, r.id) < ($1, $2))
   AND ($3 = '' OR r.state = $3)
 ORDER BY r.created_at DESC, r.id DESC LIMIT $4`

const runNodesSQL = `
SELECT run_id, node_id, state, coalesce(command_id, ''), coalesce(exit_code, 0), error, started_at, finished_at
  FROM run_nodes WHERE run_id = $1 ORDER BY node_id`

const lockRunSQL = `SELECT state FROM runs WHERE id = $1 FOR UPDATE`

const cancelRunSQL = `
UPDATE runs SET state = 'cancelled', reason = $2, finished_at = compute_now(), updated_at = compute_now()
 WHERE id = $1 AND state = 'running'`

const notStartRunNodesSQL = `
UPDATE run_nodes SET state = 'not_started', error = $2, finished_at = compute_now(), updated_at = compute_now()
 WHERE run_id = $1 AND state = 'pending'`

const runningRunCommandsSQL = `
SELECT command_id FROM run_nodes WHERE run_id = $1 AND state = 'running' ORDER BY node_id`

// runTarget is runs.target's JSON.
type runTarget struct {
	NodeIDs  []string `json:"node_ids,omitempty"`
	Selector string   `json:"selector,omitempty"`
	PoolID   string   `json:"pool_id,omitempty"`
}

func scanRun(row pgx.Row) (*controlv1.Run, time.Time, error) {
	var (
		r                  controlv1.Run
		target, counts     []byte
		timeoutMs, pauseMs int64
		state              string
		created            time.Time
		finished           *time.Time
	)
	if err := row.Scan(&r.Id, &target, &r.Kind, &r.Payload, &timeoutMs, &r.MaxInFlight, &r.MaxFailures, &pauseMs,
		&state, &r.Reason, &r.IdempotencyKey, &r.Description, &created, &finished, &counts); err != nil {
		return nil, time.Time{}, err
	}
	var t runTarget
	if err := json.Unmarshal(target, &t); err != nil {
		return nil, time.Time{}, fmt.Errorf("decode target of run %s: %w", r.Id, err)
	}
	r.Target = &controlv1.RunTarget{NodeIds: t.NodeIDs, Selector: t.Selector, PoolId: t.PoolID}
	if err := json.Unmarshal(counts, &r.Counts); err != nil {
		return nil, time.Time{}, fmt.Errorf("decode counts of run %s: %w", r.Id, err)
	}
	for _, n := range r.Counts {
		r.Total += n
	}
	r.CommandTimeout, r.BatchPause = durationMs(timeoutMs), durationMs(pauseMs)
	r.State = runStates[state]
	r.CreatedAt, r.FinishedAt = ts(created), tsPtr(finished)
	return &r, created, nil
}

func scanRunNode(row pgx.Row) (*controlv1.RunNode, error) {
	var (
		n                 controlv1.RunNode
		state             string
		started, finished *time.Time
	)
	if err := row.Scan(&n.RunId, &n.NodeId, &state, &n.CommandId, &n.ExitCode, &n.Error, &started, &finished); err != nil {
		return nil, err
	}
	n.State = runNodeStates[state]
	n.StartedAt, n.FinishedAt = tsPtr(started), tsPtr(finished)
	return &n, nil
}

func (h *Handler) readRunNodes(ctx context.Context, q pgdb.Querier, id string) ([]*controlv1.RunNode, error) {
	rows, err := q.Query(ctx, runNodesSQL, id)
	if err != nil {
		return nil, fmt.Errorf("read nodes of run %s: %w", id, err)
	}
	nodes, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (*controlv1.RunNode, error) { return scanRunNode(r) })
	if err != nil {
		return nil, fmt.Errorf("read nodes of run %s: %w", id, err)
	}
	return nodes, nil
}

func (h *Handler) readRun(ctx context.Context, q pgdb.Querier, id string) (*controlv1.Run, error) {
	r, _, err := scanRun(q.QueryRow(ctx, getRunSQL, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, notFound("run_id", "run", id)
	}
	if err != nil {
		return nil, fmt.Errorf("read run %s: %w", id, err)
	}
	return r, nil
}

// CreateRun resolves the target to its nodes and records the run with one
// row per node in one transaction, then enqueues the run for the workers'
// reconciler. Cordoned (or draining) nodes are recorded SKIPPED; a target
// that matches no node is FAILED_PRECONDITION and writes nothing. With an
// idempotency key a repeat with the same kind and payload returns the first
// run (created=false); another kind or payload is ALREADY_EXISTS.
func (h *Handler) CreateRun(ctx context.Context, req *connect.Request[controlv1.CreateRunRequest]) (*connect.Response[controlv1.CreateRunResponse], error) {
	m := req.Msg
	c, err := validateCreateRun(m, h.defaultTimeout, h.maxPayload)
	if err != nil {
		return nil, err
	}
	payload := m.GetPayload()
	if payload == nil {
		payload = []byte{}
	}
	caller := ""
	if id, ok := IdentityFrom(ctx); ok {
		caller = id.ID
	}
	resp := &controlv1.CreateRunResponse{}
	err = pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		if c.key != nil {
			if done, err := h.repeatedRun(ctx, tx, c.key, m.GetKind(), payload, resp); done || err != nil {
				return err
			}
		}
		if c.poolID != "" {
			if err := tx.QueryRow(ctx, lockPoolSQL, c.poolID).Scan(new(int)); errors.Is(err, pgx.ErrNoRows) {
				return notFound("target.pool_id", "pool", c.poolID)
			} else if err != nil {
				return fmt.Errorf("lock pool %s: %w", c.poolID, err)
			}
		}
		if len(c.nodeIDs) > 0 {
			var missing string
			if err := tx.QueryRow(ctx, missingNodesSQL, c.nodeIDs).Scan(&missing); err == nil {
				return notFound("target.node_ids", "node", missing)
			} else if !errors.Is(err, pgx.ErrNoRows) {
				return fmt.Errorf("check target nodes: %w", err)
			}
		}
		rows, err := tx.Query(ctx, resolveRunNodesSQL, c.nodeIDs, c.poolID, c.sel.SQLArg())
		if err != nil {
			return fmt.Errorf("resolve run target: %w", err)
		}
		var ids, states, reasons []string
		var id string
		var cordoned bool
		_, err = pgx.ForEachRow(rows, []any{&id, &cordoned}, func() error {
			ids = append(ids, id)
			if cordoned {
				states, reasons = append(states, "skipped"), append(reasons, "node is cordoned (or draining)")
			} else {
				states, reasons = append(states, "pending"), append(reasons, "")
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("resolve run target: %w", err)
		}
		if len(ids) == 0 {
			return connect.NewError(connect.CodeFailedPrecondition, errors.New("target: matches no node"))
		}
		inFlight := max(1, c.inFlight.resolve(len(ids), true))
		failures := c.failures.resolve(len(ids), false)
		target, err := json.Marshal(runTarget{NodeIDs: c.nodeIDs, Selector: c.selText, PoolID: c.poolID})
		if err != nil {
			return fmt.Errorf("encode target: %w", err)
		}
		var runID string
		err = tx.QueryRow(ctx, insertRunSQL, string(target), m.GetKind(), payload, c.timeout.Seconds(), inFlight, failures,
			c.batchPause.Seconds(), c.key, c.description, caller).Scan(&runID)
		if errors.Is(err, pgx.ErrNoRows) && c.key != nil {
			// A concurrent create took the key; the insert waited for it, so
			// its run is committed and visible now.
			done, err := h.repeatedRun(ctx, tx, c.key, m.GetKind(), payload, resp)
			if err == nil && !done {
				err = fmt.Errorf("run of idempotency key %q vanished", *c.key)
			}
			return err
		}
		if err != nil {
			return fmt.Errorf("insert run: %w", err)
		}
		if _, err := tx.Exec(ctx, insertRunNodesSQL, runID, ids, states, reasons); err != nil {
			return fmt.Errorf("insert nodes of run %s: %w", runID, err)
		}
		if _, err := queue.Enqueue(ctx, tx, RunsReconciler, runID, 0); err != nil {
			return fmt.Errorf("enqueue run %s: %w", runID, err)
		}
		if resp.Run, err = h.readRun(ctx, tx, runID); err != nil {
			return err
		}
		resp.Created = true
		return h.recordAudit(ctx, tx, auditEvent{Method: "CreateRun", TargetKind: "run", TargetID: runID,
			Detail: map[string]any{"kind": m.GetKind(), "nodes": len(ids), "max_in_flight": inFlight, "max_failures": failures}})
	})
	if err != nil {
		return nil, h.fail(ctx, "create run", err)
	}
	return connect.NewResponse(resp), nil
}

// repeatedRun answers a CreateRun whose idempotency key is taken: done is
// true (and resp set) when a run has the key.
func (h *Handler) repeatedRun(ctx context.Context, tx pgx.Tx, key *string, kind string, payload []byte, resp *controlv1.CreateRunResponse) (bool, error) {
	r, _, err := scanRun(tx.QueryRow(ctx, runByKeySQL, *key))
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read run of idempotency key: %w", err)
	}
	if r.GetKind() != kind || !bytes.Equal(r.GetPayload(), payload) {
		return false, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf(
			"idempotency_key: already used for run %s with another kind or payload", r.GetId()))
	}
	resp.Run, resp.Created = r, false
	return true, h.recordAudit(ctx, tx, auditEvent{Method: "CreateRun", TargetKind: "run", TargetID: r.GetId(),
		Outcome: outcomeUnchanged, Detail: map[string]any{"kind": kind}})
}

// GetRun returns a run and its nodes (by node id).
func (h *Handler) GetRun(ctx context.Context, req *connect.Request[controlv1.GetRunRequest]) (*connect.Response[controlv1.GetRunResponse], error) {
	id := req.Msg.GetRunId()
	if err := checkRE("run_id", id, idRE); err != nil {
		return nil, err
	}
	resp := &controlv1.GetRunResponse{}
	// One snapshot: the counts agree with the nodes.
	err := pgx.BeginTxFunc(ctx, h.db, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		var err error
		if resp.Run, err = h.readRun(ctx, tx, id); err != nil {
			return err
		}
		resp.Nodes, err = h.readRunNodes(ctx, tx, id)
		return err
	})
	if err != nil {
		return nil, h.fail(ctx, "get run", err)
	}
	return connect.NewResponse(resp), nil
}

// ListRuns returns runs newest first.
func (h *Handler) ListRuns(ctx context.Context, req *connect.Request[controlv1.ListRunsRequest]) (*connect.Response[controlv1.ListRunsResponse], error) {
	const method = "ListRuns"
	m := req.Msg
	if err := checkPage(m.GetPageSize(), m.GetPageToken()); err != nil {
		return nil, err
	}
	if err := checkEnum("state", m.GetState(), controlv1.RunState_name, true); err != nil {
		return nil, err
	}
	p, err := openPage(method, m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	resp := &controlv1.ListRunsResponse{}
	err = h.readList(ctx, "list runs", func(ctx context.Context, q pgdb.Querier) error {
		rows, err := q.Query(ctx, listRunsSQL, p.after.after(), p.after.ID, dbName(runStates, m.GetState()), p.limit())
		if err != nil {
			return err
		}
		resp.Runs, resp.NextPageToken, err = collectPageWithin(p, rows, func(r pgx.Rows) (*controlv1.Run, pageKey, error) {
			run, created, err := scanRun(r)
			return run, pageKey{ID: run.GetId(), At: created.UnixMicro()}, err
		}, func(r *controlv1.Run) int { return len(r.GetPayload()) }, maxListPayloadBytes)
		return err
	})
	if err != nil {
		return nil, h.fail(ctx, "list runs", err)
	}
	return connect.NewResponse(resp), nil
}

// CancelRun ends a running run as cancelled with the reason: pending nodes
// become NOT_STARTED and every running node's command is cancelled as
// CancelCommand cancels it (its node is told to stop), all in one
// transaction with the audit rows. The run row is locked FOR UPDATE, as the
// reconciler locks it, so no node starts after the cancel commits. A run
// already ended is returned unchanged.
func (h *Handler) CancelRun(ctx context.Context, req *connect.Request[controlv1.CancelRunRequest]) (*connect.Response[controlv1.CancelRunResponse], error) {
	m := req.Msg
	id := m.GetRunId()
	if err := checkRE("run_id", id, idRE); err != nil {
		return nil, err
	}
	if err := checkText("reason", m.GetReason(), maxRunReason); err != nil {
		return nil, err
	}
	reason := m.GetReason()
	if reason == "" {
		reason = "cancelled by CancelRun"
	}
	var (
		run       *controlv1.Run
		cancelled []*controlv1.Command
	)
	err := pgdb.InTx(ctx, h.db, func(tx pgx.Tx) error {
		cancelled = nil
		var state string
		if err := tx.QueryRow(ctx, lockRunSQL, id).Scan(&state); errors.Is(err, pgx.ErrNoRows) {
			return notFound("run_id", "run", id)
		} else if err != nil {
			return fmt.Errorf("lock run %s: %w", id, err)
		}
		ev := auditEvent{Method: "CancelRun", TargetKind: "run", TargetID: id, Outcome: outcomeUnchanged,
			Detail: map[string]any{"state": state}}
		if state == "running" {
			if _, err := tx.Exec(ctx, cancelRunSQL, id, reason); err != nil {
				return fmt.Errorf("cancel run %s: %w", id, err)
			}
			tag, err := tx.Exec(ctx, notStartRunNodesSQL, id, "run cancelled: "+reason)
			if err != nil {
				return fmt.Errorf("stop pending nodes of run %s: %w", id, err)
			}
			rows, err := tx.Query(ctx, runningRunCommandsSQL, id)
			if err != nil {
				return fmt.Errorf("read running nodes of run %s: %w", id, err)
			}
			cmdIDs, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				return fmt.Errorf("read running nodes of run %s: %w", id, err)
			}
			for _, c := range cmdIDs {
				cmd, err := h.cancelCommandTx(ctx, tx, c, map[string]any{"run_id": id})
				if err != nil {
					return err
				}
				cancelled = append(cancelled, cmd)
			}
			// The reconciler copies the cancelled commands' outcome to
			// their nodes.
			if _, err := queue.Enqueue(ctx, tx, RunsReconciler, id, 0); err != nil {
				return fmt.Errorf("enqueue run %s: %w", id, err)
			}
			ev.Outcome = "ok"
			ev.Detail = map[string]any{"reason": reason, "not_started": tag.RowsAffected(), "commands_cancelled": len(cmdIDs)}
		}
		var err error
		if run, err = h.readRun(ctx, tx, id); err != nil {
			return err
		}
		return h.recordAudit(ctx, tx, ev)
	})
	if err != nil {
		return nil, h.fail(ctx, "cancel run", err)
	}
	for _, cmd := range cancelled {
		h.wakeCancelled(cmd)
	}
	return connect.NewResponse(&controlv1.CancelRunResponse{Run: run}), nil
}

func terminalRun(s controlv1.RunState) bool {
	return s != controlv1.RunState_RUN_STATE_RUNNING && s != controlv1.RunState_RUN_STATE_UNSPECIFIED
}

// WaitRun waits until the run is terminal, the timeout passes, the
// caller's deadline is near or the server stops, then returns the run as
// it stands. It reads the run every --api.wait-poll-interval.
func (h *Handler) WaitRun(ctx context.Context, req *connect.Request[controlv1.WaitRunRequest]) (*connect.Response[controlv1.WaitRunResponse], error) {
	m := req.Msg
	id := m.GetRunId()
	if err := checkRE("run_id", id, idRE); err != nil {
		return nil, err
	}
	wait := DefaultWait
	if m.GetTimeout() != nil {
		d, err := checkDuration("timeout", m.GetTimeout(), 0, MaxWait)
		if err != nil {
			return nil, err
		}
		wait = d
	}
	if dl, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(dl)-waitMargin)
	}
	limit := time.NewTimer(max(wait, 0))
	defer limit.Stop()
	tick := time.NewTicker(h.waiter.interval)
	defer tick.Stop()
	for {
		run, err := h.readRun(ctx, h.db, id)
		if err != nil {
			return nil, h.fail(ctx, "wait run", err)
		}
		if terminalRun(run.GetState()) || wait <= 0 {
			return connect.NewResponse(&controlv1.WaitRunResponse{Run: run}), nil
		}
		select {
		case <-tick.C:
		case <-limit.C:
			wait = 0 // read once more and answer
		case <-h.waiter.stopping():
			wait = 0
		case <-ctx.Done():
			return nil, h.fail(ctx, "wait run", ctx.Err())
		}
	}
}

// StreamRunNodes sends every node of the run once, then each node whose
// state changed, read every --api.wait-poll-interval; it ends (OK) once the
// run is terminal and no node is pending or running. A call stays open at
// most 60 s (DEADLINE_EXCEEDED; call again: every node is sent once more).
func (h *Handler) StreamRunNodes(ctx context.Context, req *connect.Request[controlv1.StreamRunNodesRequest], stream *connect.ServerStream[controlv1.StreamRunNodesResponse]) error {
	id := req.Msg.GetRunId()
	if err := checkRE("run_id", id, idRE); err != nil {
		return err
	}
	limit := time.NewTimer(maxStreamDuration)
	defer limit.Stop()
	tick := time.NewTicker(h.waiter.interval)
	defer tick.Stop()
	sent := map[string]string{}
	for {
		var (
			run   *controlv1.Run
			nodes []*controlv1.RunNode
		)
		err := pgx.BeginTxFunc(ctx, h.db, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
			var err error
			if run, err = h.readRun(ctx, tx, id); err != nil {
				return err
			}
			nodes, err = h.readRunNodes(ctx, tx, id)
			return err
		})
		if err != nil {
			return h.fail(ctx, "stream run nodes", err)
		}
		settled := true
		for _, n := range nodes {
			if n.GetState() == controlv1.RunNodeState_RUN_NODE_STATE_PENDING || n.GetState() == controlv1.RunNodeState_RUN_NODE_STATE_RUNNING {
				settled = false
			}
			seen := n.GetState().String() + "/" + n.GetCommandId()
			if sent[n.GetNodeId()] == seen {
				continue
			}
			if err := stream.Send(&controlv1.StreamRunNodesResponse{Node: n}); err != nil {
				return h.fail(ctx, "stream run nodes", err)
			}
			sent[n.GetNodeId()] = seen
		}
		if terminalRun(run.GetState()) && settled {
			return nil
		}
		select {
		case <-tick.C:
		case <-limit.C:
			return connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("stream open for %s; call again", maxStreamDuration))
		case <-h.waiter.stopping():
			return connect.NewError(connect.CodeUnavailable, errors.New("server stopping; call again"))
		case <-ctx.Done():
			return h.fail(ctx, "stream run nodes", ctx.Err())
		}
	}
}
