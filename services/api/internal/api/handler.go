package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/leasehold/leasehold/pkg/cmdwake"
	"github.com/leasehold/leasehold/pkg/egress"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

// Handler implements ControlService over the database. Every method
// validates its whole request before it runs any SQL.
type Handler struct {
	db *pgxpool.Pool
	// reads serves the list RPCs when --api.read-database-url is set
	// (readList); nil reads everything from db.
	reads          *readReplica
	log            *slog.Logger
	waiter         *waiter
	wake           *cmdwake.Notifier
	defaultTimeout time.Duration
	maxPayload     int // --api.max-payload-bytes
	maxQueued      int // --api.max-queued-per-node; 0: no cap
	// overload is the gateways' overload as last read; nil with
	// --api.overload-admission=false.
	overload *overloadWatch
	// group writes creates without an idempotency key in groups
	// (createbatch.go); nil writes each alone.
	group *createGroup
	// sinkEgress judges sink URLs at creation (the worker judges the
	// resolved address again at delivery).
	sinkEgress egress.Policy
	// relay reaches gateways' tunnel relays; nil refuses OpenTunnel.
	relay *relayDialer
}

var _ controlv1connect.ControlServiceHandler = (*Handler)(nil)

// fail turns err into the error a client sees. Errors already carrying a
// Connect code pass through; database errors become INTERNAL (logged here,
// never shown) or UNAVAILABLE when the database cannot be reached.
func (h *Handler) fail(ctx context.Context, op string, err error) error {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(ctx.Err(), context.DeadlineExceeded):
		return connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("%s: deadline exceeded", op))
	case errors.Is(err, context.Canceled) || errors.Is(ctx.Err(), context.Canceled):
		return connect.NewError(connect.CodeCanceled, fmt.Errorf("%s: canceled", op))
	case pgdb.IsConnectionError(err):
		h.log.WarnContext(ctx, "database unavailable", "op", op, "err", err)
		return connect.NewError(connect.CodeUnavailable, errors.New("database unavailable; retry"))
	}
	h.log.ErrorContext(ctx, "request failed", "op", op, "err", err)
	return connect.NewError(connect.CodeInternal, fmt.Errorf("%s: internal error", op))
}

func notFound(field, what, id string) error {
	return connect.NewError(connect.CodeNotFound, fmt.Errorf("%s: %s %q not found", field, what, id))
}

var (
	nodeKinds = map[string]nodev1.NodeKind{"node": nodev1.NodeKind_NODE_KIND_NODE, "site_agent": nodev1.NodeKind_NODE_KIND_SITE_AGENT}

	nodeStates = map[string]controlv1.NodeState{
		"registered": controlv1.NodeState_NODE_STATE_REGISTERED, "connected": controlv1.NodeState_NODE_STATE_CONNECTED,
		"disconnected": controlv1.NodeState_NODE_STATE_DISCONNECTED, "unreachable": controlv1.NodeState_NODE_STATE_UNREACHABLE,
		"revoked": controlv1.NodeState_NODE_STATE_REVOKED,
	}
	commandStates = map[string]controlv1.CommandState{
		"pending": controlv1.CommandState_COMMAND_STATE_PENDING, "dispatched": controlv1.CommandState_COMMAND_STATE_DISPATCHED,
		"acknowledged": controlv1.CommandState_COMMAND_STATE_RUNNING, "succeeded": controlv1.CommandState_COMMAND_STATE_SUCCEEDED,
		"failed": controlv1.CommandState_COMMAND_STATE_FAILED, "cancelled": controlv1.CommandState_COMMAND_STATE_CANCELLED,
		"expired": controlv1.CommandState_COMMAND_STATE_EXPIRED,
	}
	poolLeaseStates = map[string]controlv1.PoolLeaseState{
		"pending": controlv1.PoolLeaseState_POOL_LEASE_STATE_PENDING, "allocated": controlv1.PoolLeaseState_POOL_LEASE_STATE_ALLOCATED,
		"released": controlv1.PoolLeaseState_POOL_LEASE_STATE_RELEASED,
	}
)

// dbName returns the column value of enum value v in m ("" for 0).
func dbName[E comparable](m map[string]E, v E) string {
	var zero E
	if v == zero {
		return ""
	}
	for k, e := range m {
		if e == v {
			return k
		}
	}
	return ""
}

func terminalCommand(s controlv1.CommandState) bool {
	switch s {
	case controlv1.CommandState_COMMAND_STATE_SUCCEEDED, controlv1.CommandState_COMMAND_STATE_FAILED,
		controlv1.CommandState_COMMAND_STATE_CANCELLED, controlv1.CommandState_COMMAND_STATE_EXPIRED:
		return true
	}
	return false
}

func ts(t time.Time) *timestamppb.Timestamp { return timestamppb.New(t) }

func tsPtr(t *time.Time) *timestamppb.Timestamp {
	if t == nil {
		return nil
	}
	return timestamppb.New(*t)
}

// tsFinite converts a timestamptz that may be ±infinity (a released
// lease's expires_at); infinity gives nil.
func tsFinite(t pgtype.Timestamptz) *timestamppb.Timestamp {
	if !t.Valid || t.InfinityModifier != pgtype.Finite {
		return nil
	}
	return timestamppb.New(t.Time)
}

// decodeLabels reads a jsonb object of labels; non-string values (written
// by something other than the API) are shown in their JSON form.
func decodeLabels(raw []byte) (map[string]string, error) {
	if len(raw) == 0 {
		return nil, nil
	}
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, fmt.Errorf("decode labels: %w", err)
	}
	out := make(map[string]string, len(m))
	for k, v := range m {
		if s, ok := v.(string); ok {
			out[k] = s
			continue
		}
		b, _ := json.Marshal(v)
		out[k] = string(b)
	}
	return out, nil
}

// encodeLabels returns labels as JSON text. jsonb parameters are passed as
// text, never []byte: behind PgBouncer (simple protocol) a []byte is sent as
// bytea and is not valid JSON.
func encodeLabels(m map[string]string) string {
	if len(m) == 0 {
		return "{}"
	}
	b, _ := json.Marshal(m)
	return string(b)
}

func scanNode(row pgx.Row) (*controlv1.Node, error) {
	var (
		n                 controlv1.Node
		kind, state       string
		labels            []byte
		lastSeen, revoked *time.Time
		cordoned          *time.Time
		created           time.Time
	)
	if err := row.Scan(&n.Id, &kind, &n.SiteId, &labels, &n.PoolId, &state, &n.SessionEpoch, &n.GatewayId,
		&n.DaemonVersion, &lastSeen, &created, &revoked, &cordoned); err != nil {
		return nil, err
	}
	var err error
	if n.Labels, err = decodeLabels(labels); err != nil {
		return nil, err
	}
	n.Kind = nodeKinds[kind]
	n.State = nodeStates[state]
	n.LastSeenAt, n.CreatedAt, n.RevokedAt = tsPtr(lastSeen), ts(created), tsPtr(revoked)
	n.Cordoned, n.CordonedAt = cordoned != nil, tsPtr(cordoned)
	return &n, nil
}

func scanCommand(row pgx.Row) (*controlv1.Command, time.Time, error) {
	var (
		c                controlv1.Command
		state            string
		deadline         *time.Time
		created, updated time.Time
	)
	var cancelRequested *time.Time
	if err := row.Scan(&c.Id, &c.NodeId, &c.Kind, &c.Payload, &state, &deadline, &c.IdempotencyKey, &c.DispatchCount,
		&created, &updated, &cancelRequested, &c.CancelConfirmed, &c.CancelOutcome, &c.OutputBytes, &c.OutputTruncated); err != nil {
		return nil, time.Time{}, err
	}
	c.State = commandStates[state]
	c.Deadline, c.CreatedAt, c.UpdatedAt = tsPtr(deadline), ts(created), ts(updated)
	c.CancelRequestedAt = tsPtr(cancelRequested)
	return &c, created, nil
}

func scanResult(row pgx.Row) (*controlv1.CommandResult, error) {
	var (
		r                 controlv1.CommandResult
		started, finished *time.Time
		received          time.Time
	)
	if err := row.Scan(&r.CommandId, &r.ResultId, &r.ExitCode, &r.Output, &r.Error, &started, &finished, &received); err != nil {
		return nil, err
	}
	r.StartedAt, r.FinishedAt, r.ReceivedAt = tsPtr(started), tsPtr(finished), ts(received)
	return &r, nil
}

func scanPool(row pgx.Row) (*controlv1.Pool, error) {
	var (
		p       controlv1.Pool
		labels  []byte
		created time.Time
	)
	if err := row.Scan(&p.Id, &p.Description, &labels, &p.NodeCount, &created); err != nil {
		return nil, err
	}
	var err error
	if p.Labels, err = decodeLabels(labels); err != nil {
		return nil, err
	}
	p.CreatedAt = ts(created)
	return &p, nil
}

func scanPoolLease(row pgx.Row) (*controlv1.PoolLease, time.Time, error) {
	var (
		l                controlv1.PoolLease
		selector         []byte
		state            string
		created, updated time.Time
		released         *time.Time
	)
	if err := row.Scan(&l.Id, &l.PoolId, &l.Tenant, &l.Count, &selector, &state, &created, &updated, &released,
		&l.AllocatedNodeIds); err != nil {
		return nil, time.Time{}, err
	}
	var err error
	if l.Selector, err = decodeLabels(selector); err != nil {
		return nil, time.Time{}, err
	}
	l.State = poolLeaseStates[state]
	l.CreatedAt, l.UpdatedAt, l.ReleasedAt = ts(created), ts(updated), tsPtr(released)
	return &l, created, nil
}

func scanSink(row pgx.Row) (*controlv1.Sink, error) {
	var (
		s       controlv1.Sink
		kind    string
		created time.Time
	)
	if err := row.Scan(&s.Id, &kind, &s.Url, &s.HasSecret, &created); err != nil {
		return nil, err
	}
	if kind == "webhook" {
		s.Kind = controlv1.SinkKind_SINK_KIND_WEBHOOK
	}
	s.CreatedAt = ts(created)
	return &s, nil
}

func durationMs(ms int64) *durationpb.Duration {
	return durationpb.New(time.Duration(ms) * time.Millisecond)
}
