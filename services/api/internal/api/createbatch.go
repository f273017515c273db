package api

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/pkg/audit"
	"github.com/leasehold/leasehold/pkg/cmdstore"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

// Creates without an idempotency key are written in groups: concurrent
// CreateCommand calls that arrive while another group is being written
// share the next transaction (the api's group commit). Each call is judged
// on its own (its node found and not revoked, its node's queue cap, its
// gateway's overload, its deadline) and gets its own answer; the group
// costs the database one node lock, one insert, one audit insert and one
// commit, where single creates cost each of those per command. A group is
// what queued while the previous one was written, so an idle api writes a
// create at once, alone, and a busy one writes larger groups.
//
// A keyed create is written alone (CreateCommand's own transaction): its
// repeat and conflict rules read the row a concurrent create of the same
// key inserted.

const (
	// createWorkers is how many groups are written at once: while one
	// commits, the next collects and writes, and a group that waits on a
	// node's lock (a revocation in flight) does not hold up every create.
	// More writers make smaller groups: on the throughput bench (2 cores,
	// 16 callers) 1, 2 and 4 writers gave groups of 7.5, 4.2 and 2.6 and
	// 0.28, 0.35 and 0.44 ms of PostgreSQL CPU per command
	// (docs/decisions.md, "Creates in groups").
	createWorkers = 2
	// maxGroupPayload bounds the payload bytes of one group.
	maxGroupPayload = 4 << 20
	// groupTimeout bounds one group's transaction.
	groupTimeout = 15 * time.Second
)

// errGroupStopped is returned by createGroup.create once its workers have
// stopped; the caller writes the create alone.
var errGroupStopped = errors.New("create group stopped")

// pendingCreate is one unkeyed CreateCommand waiting for its group.
type pendingCreate struct {
	ctx         context.Context // the caller's: identity, trace, whether it still waits
	m           *controlv1.CreateCommandRequest
	payload     []byte
	c           createCommand
	traceparent *string
	actor, role string
	done        chan createAnswer // buffered: a worker never waits on a caller
}

type createAnswer struct {
	cmd *controlv1.Command
	err error
}

// createGroup writes pending creates in groups of at most max.
type createGroup struct {
	h       *Handler
	max     int
	in      chan *pendingCreate
	stopped chan struct{}
	size    prometheus.Histogram
	waiting prometheus.Gauge
	writing prometheus.Gauge
}

func newCreateGroup(h *Handler, maxSize int, reg prometheus.Registerer) *createGroup {
	return &createGroup{h: h, max: maxSize, in: make(chan *pendingCreate), stopped: make(chan struct{}),
		size: promauto.With(reg).NewHistogram(prometheus.HistogramOpts{
			Name:    "leasehold_api_create_group_size",
			Help:    "Commands written per CreateCommand group transaction (creates without an idempotency key).",
			Buckets: prometheus.ExponentialBuckets(1, 2, 10),
		}),
		waiting: promauto.With(reg).NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_api_creates_waiting",
			Help: "CreateCommand calls waiting for a group to take them: every group writer is busy.",
		}),
		writing: promauto.With(reg).NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_api_creates_writing",
			Help: "CreateCommand calls in a group transaction now.",
		})}
}

// run writes groups until ctx ends; creates that arrive after it returns
// are written alone. It runs once.
func (g *createGroup) run(ctx context.Context) {
	defer close(g.stopped)
	var wg sync.WaitGroup
	for range createWorkers {
		wg.Go(func() {
			for {
				select {
				case <-ctx.Done():
					return
				case first := <-g.in:
					g.write(ctx, g.collect(first))
				}
			}
		})
	}
	wg.Wait()
}

// create hands p to a worker and waits for its answer.
func (g *createGroup) create(p *pendingCreate) (*controlv1.Command, error) {
	var err error
	g.waiting.Inc()
	select {
	case g.in <- p:
	case <-g.stopped:
		err = errGroupStopped
	case <-p.ctx.Done():
		err = p.ctx.Err()
	}
	g.waiting.Dec()
	if err != nil {
		return nil, err
	}
	select {
	case a := <-p.done:
		return a.cmd, a.err
	case <-p.ctx.Done():
		// The group may still write it, as a create whose answer was lost
		// on the way back always could be.
		return nil, p.ctx.Err()
	}
}

// collect is first and whatever else already waits, up to the group's
// bounds; a caller that stopped waiting is left out.
func (g *createGroup) collect(first *pendingCreate) []*pendingCreate {
	group := []*pendingCreate{first}
	bytes := len(first.payload)
	for len(group) < g.max && bytes < maxGroupPayload {
		select {
		case p := <-g.in:
			if p.ctx.Err() != nil {
				p.done <- createAnswer{err: p.ctx.Err()}
				continue
			}
			group = append(group, p)
			bytes += len(p.payload)
		default:
			return group
		}
	}
	return group
}

// write writes group in one transaction and answers each of its creates.
func (g *createGroup) write(ctx context.Context, group []*pendingCreate) {
	g.size.Observe(float64(len(group)))
	g.writing.Add(float64(len(group)))
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), groupTimeout)
	defer cancel()
	// The group's statements are traced as children of its first traced
	// call (a group of one: of its call); every command keeps its own
	// call's traceparent for the gateway's dispatch and result spans.
	for _, p := range group {
		if span := trace.SpanFromContext(p.ctx); span.SpanContext().IsValid() {
			ctx = trace.ContextWithSpan(ctx, span) // the call waits for its answer: its span is still open
			break
		}
	}
	answers := make([]createAnswer, len(group))
	err := pgdb.InTx(ctx, g.h.db, func(tx pgx.Tx) error {
		return g.h.createGroupTx(ctx, tx, group, answers)
	})
	g.writing.Sub(float64(len(group)))
	if err != nil {
		err = g.h.fail(ctx, "create command", err)
	}
	for i, p := range group {
		a := answers[i]
		switch {
		case err != nil && a.err == nil:
			a = createAnswer{err: err} // the transaction failed: nothing was written
		case a.cmd != nil:
			g.h.logAudit(p.ctx, "CreateCommand", "command", a.cmd.GetId(), "ok", p.actor, p.role)
		}
		p.done <- a
	}
}

// createGroupTx judges and writes group in tx, filling answers.
func (h *Handler) createGroupTx(ctx context.Context, tx pgx.Tx, group []*pendingCreate, answers []createAnswer) error {
	type lockedNode struct {
		state  string
		now    time.Time
		queued int
	}
	ids := make([]string, 0, len(group))
	seen := make(map[string]bool, len(group))
	for _, p := range group {
		if id := p.m.GetNodeId(); !seen[id] {
			seen[id] = true
			ids = append(ids, id)
		}
	}
	rows, err := tx.Query(ctx, cmdstore.LockNodesSQL, ids, h.maxQueued)
	if err != nil {
		return fmt.Errorf("lock nodes: %w", err)
	}
	nodes := make(map[string]*lockedNode, len(ids))
	for rows.Next() {
		var id string
		var n lockedNode
		if err := rows.Scan(&id, &n.state, &n.now, &n.queued); err != nil {
			rows.Close()
			return fmt.Errorf("lock nodes: %w", err)
		}
		nodes[id] = &n
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("lock nodes: %w", err)
	}

	n := len(group)
	var (
		cmdIDs, nodeIDs, kinds = make([]string, 0, n), make([]string, 0, n), make([]string, 0, n)
		payloads               = make([][]byte, 0, n)
		deadlines              = make([]time.Time, 0, n)
		tps                    = make([]*string, 0, n)
		slot                   = make(map[string]int, n) // command id -> index in group
	)
	for i, p := range group {
		node, ok := nodes[p.m.GetNodeId()]
		switch {
		case !ok:
			answers[i].err = notFound("node_id", "node", p.m.GetNodeId())
			continue
		case node.state == "revoked":
			answers[i].err = revokedNode(p.m.GetNodeId())
			continue
		}
		if refusal := h.admit(p.m.GetNodeId(), node.queued); refusal != nil {
			answers[i].err = refusal
			continue
		}
		deadline, err := p.c.deadlineAt(node.now)
		if err != nil {
			answers[i].err = err
			continue
		}
		node.queued++ // the queue cap counts the group's own commands
		id := uuid.NewString()
		slot[id] = i
		cmdIDs, nodeIDs, kinds = append(cmdIDs, id), append(nodeIDs, p.m.GetNodeId()), append(kinds, p.m.GetKind())
		payloads, deadlines, tps = append(payloads, p.payload), append(deadlines, deadline), append(tps, p.traceparent)
	}
	if len(cmdIDs) == 0 {
		return nil
	}
	rows, err = tx.Query(ctx, cmdstore.InsertRowsSQL+commandReturning, cmdIDs, nodeIDs, kinds, payloads, deadlines, tps)
	if err != nil {
		return fmt.Errorf("insert commands: %w", err)
	}
	for rows.Next() {
		cmd, _, err := scanCommand(rows)
		if err != nil {
			rows.Close()
			return fmt.Errorf("insert commands: %w", err)
		}
		answers[slot[cmd.GetId()]].cmd = cmd
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("insert commands: %w", err)
	}
	events := make([]audit.Event, 0, len(cmdIDs))
	for _, id := range cmdIDs {
		p := group[slot[id]]
		events = append(events, audit.Event{Actor: p.actor, Role: p.role, Method: "CreateCommand", TargetKind: "command", TargetID: id,
			Detail: map[string]any{"node_id": p.m.GetNodeId(), "kind": p.m.GetKind()}})
	}
	return audit.RecordMany(ctx, tx, events)
}
