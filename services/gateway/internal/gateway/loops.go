package gateway

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/leasehold/leasehold/pkg/cmdwake"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgnotify"
)

// livenessLoop extends every session this gateway holds with one batched
// statement per tick, guarded by session epoch. A session the statement does
// not return is a zombie (its node said Hello elsewhere) and is closed. A
// node silent for three heartbeat intervals is closed too.
func (g *Gateway) livenessLoop(ctx context.Context) {
	t := g.clock.NewTicker(g.cfg.LivenessInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.Chan():
		}
		if g.Fenced() {
			continue // nothing to prove until the lease is taken again
		}
		if err := g.livenessOnce(ctx); err != nil && !g.Fenced() && ctx.Err() == nil {
			g.log.Warn("session liveness write failed", "err", err)
		}
	}
}

func (g *Gateway) livenessOnce(ctx context.Context) error {
	silentBefore := g.clock.Now().Add(-3 * g.cfg.HeartbeatInterval)
	var (
		live    []*session
		ids     []string
		epochs  []int64
		skews   []*int32
		maxSkew time.Duration
	)
	for _, s := range g.snapshot() {
		if s.heldBack.Load() {
			s.touch(g.clock.Now()) // the node is sending; the gateway holds it back
		}
		if s.lastSeen().Before(silentBefore) {
			s.close(connect.NewError(connect.CodeUnavailable, fmt.Errorf("no message from node %s for %s", s.nodeID, 3*g.cfg.HeartbeatInterval)))
			continue
		}
		live = append(live, s)
		ids = append(ids, s.nodeID)
		epochs = append(epochs, s.epoch)
		var skew *int32
		if ms, ok := s.skewMillis(); ok {
			skew = &ms
			maxSkew = max(maxSkew, time.Duration(abs(int64(ms)))*time.Millisecond)
		}
		skews = append(skews, skew)
	}
	g.m.nodeSkewMax.Set(maxSkew.Seconds())
	if len(live) == 0 {
		// Still prove the lease in a fenced transaction, so a resumed
		// gateway notices a lost lease even with no sessions.
		return g.runFenced(ctx, func(context.Context, pgx.Tx) error { return nil })
	}
	matched := make(map[string]struct{}, len(live))
	err := g.runFenced(ctx, func(ctx context.Context, tx pgx.Tx) error {
		clear(matched)
		sent := g.clock.Now()
		rows, err := tx.Query(ctx, livenessSQL, g.id, ids, epochs, g.cfg.SessionLease.Seconds(), skews)
		if err != nil {
			return err
		}
		defer rows.Close()
		var dbNow time.Time
		for rows.Next() {
			var id string
			if err := rows.Scan(&id, &dbNow); err != nil {
				return err
			}
			matched[id] = struct{}{}
		}
		if err := rows.Err(); err != nil {
			return err
		}
		if !dbNow.IsZero() {
			g.observeOwnSkew(sent, g.clock.Now(), dbNow)
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, s := range live {
		if _, ok := matched[s.nodeID]; ok {
			continue
		}
		g.m.zombies.Inc()
		g.log.Info("closing zombie session: the node said Hello elsewhere", "node", s.nodeID, "epoch", s.epoch)
		s.close(connect.NewError(connect.CodeUnavailable, fmt.Errorf("session of node %s at epoch %d was superseded by a newer Hello", s.nodeID, s.epoch)))
	}
	return nil
}

// wakeDispatch asks the dispatcher to look at nodeID's pending commands
// ("" looks at every session).
func (g *Gateway) wakeDispatch(nodeID string) { g.dispatchWaker.wake(nodeID) }

// dispatchLoop dispatches pending commands of this gateway's sessions when
// woken (NOTIFY, a new session) and at every poll.
func (g *Gateway) dispatchLoop(ctx context.Context) {
	g.runWoken(ctx, g.dispatchWaker, g.cfg.DispatchPoll, "dispatch", g.dispatchFor)
}

// dispatchFor dispatches the pending commands of the woken sessions (all,
// or those of nodes), in rounds of at most DispatchBatch sessions. Cancels
// ride the same wake-ups (the api's CancelCommand wakes the node's gateway
// as a new command does; a Hello wakes its own node): the first round takes
// them in its fenced transaction, after its commands, so a wake-up costs one
// fenced transaction, not two.
func (g *Gateway) dispatchFor(ctx context.Context, all bool, nodes map[string]struct{}) error {
	var targets []*session
	g.mu.Lock()
	if all {
		for _, s := range g.sessions {
			targets = append(targets, s)
		}
	} else {
		for id := range nodes {
			if s, ok := g.sessions[id]; ok {
				targets = append(targets, s)
			}
		}
	}
	g.mu.Unlock()
	lanes := splitLanes(targets, g.cfg.DispatchBatch, dispatchLanes)
	if len(lanes) == 1 {
		return g.dispatchRounds(ctx, lanes[0])
	}
	errs := make([]error, len(lanes))
	var wg sync.WaitGroup
	for i, lane := range lanes {
		wg.Go(func() { errs[i] = g.dispatchRounds(ctx, lane) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// dispatchLanes is how many dispatch calls of one wake-up run side by side
// when its sessions fill more than one call: each lane's calls are fenced
// transactions of their own over disjoint sessions, so no two pick the same
// node's commands. One lane gave a node with two commands pending a second
// pass of every call before its second command left (docs/decisions.md,
// "Dispatch lanes").
const dispatchLanes = 2

// splitLanes deals targets into at most lanes lanes, one per batch of
// sessions, round robin; fewer sessions than two batches make one lane.
func splitLanes(targets []*session, batch, lanes int) [][]*session {
	n := min(lanes, max(1, (len(targets)+batch-1)/batch))
	if n == 1 {
		return [][]*session{targets} // the usual wake-up: no copy
	}
	out := make([][]*session, n)
	for i, s := range targets {
		out[i%n] = append(out[i%n], s)
	}
	return out
}

// dispatchRounds dispatches the pending commands of targets in rounds of at
// most DispatchBatch sessions, taking their cancels in the first round.
func (g *Gateway) dispatchRounds(ctx context.Context, targets []*session) error {
	cancelIDs := make([]string, len(targets))
	cancelEpochs := make([]int64, len(targets))
	for i, s := range targets {
		cancelIDs[i], cancelEpochs[i] = s.nodeID, s.epoch
	}
	for len(targets) > 0 {
		round, later, share := nextRound(targets, g.cfg.DispatchBatch)
		ids := make([]string, 0, len(round))
		epochs := make([]int64, 0, len(round))
		lims := make([]int32, 0, len(round))
		asked := make([]*session, 0, len(round))
		for _, s := range round {
			room, windowFull := s.room()
			lim := min(share, room)
			if lim <= 0 {
				if windowFull {
					g.m.windowFull.Inc()
				}
				continue // window or queue full: its next result (or the poll) comes back for it
			}
			ids, epochs, lims = append(ids, s.nodeID), append(epochs, s.epoch), append(lims, int32(lim))
			asked = append(asked, s)
		}
		if len(ids) == 0 {
			targets = later
			continue
		}
		got, n, err := g.dispatchOnce(ctx, ids, epochs, lims, cancelIDs, cancelEpochs)
		if err != nil {
			return err
		}
		cancelIDs, cancelEpochs = nil, nil // taken
		targets = later
		for i, s := range asked {
			// A full batch: everyone asked may have more. Otherwise only
			// the nodes that filled their share may.
			if n >= g.cfg.DispatchBatch || got[s.nodeID] >= int(lims[i]) {
				targets = append(targets, s)
			}
		}
	}
	if len(cancelIDs) > 0 {
		return g.sendCancels(ctx, cancelIDs, cancelEpochs)
	}
	return nil
}

// nextRound picks the sessions one dispatch call asks: at most batch of
// them, so the call's per-node picks (one index probe each) stay in
// proportion to the batch however many sessions the gateway holds; the
// rest wait for the following rounds. Each asked session may take share
// commands (at least one) so that together they can fill the batch.
// targets come from a map, in random order, so no node is always last.
func nextRound(targets []*session, batch int) (round, later []*session, share int) {
	round = targets
	if len(round) > batch {
		round, later = targets[:batch:batch], slices.Clone(targets[batch:])
	}
	return round, later, max(1, (batch+len(round)-1)/len(round))
}

type dispatched struct {
	nodeID      string
	epoch       int64
	cmd         *nodev1.Command
	latency     float64
	traceparent *string // of the CreateCommand call, when it was traced
}

// dispatchOnce takes up to DispatchBatch pending commands, at most lims[i]
// of node ids[i], in a transaction fenced on the gateway lease, then sends
// each to its session. With cancelIDs it also takes those sessions'
// unsent cancels (takeCancelsSQL) in the same transaction and round trip,
// and sends them after the commands. It returns how many commands each node
// got, and the total.
func (g *Gateway) dispatchOnce(ctx context.Context, ids []string, epochs []int64, lims []int32, cancelIDs []string, cancelEpochs []int64) (map[string]int, int, error) {
	var (
		out   []dispatched
		taken []takenCancel
	)
	start := spanStart()
	timer := prometheus.NewTimer(g.m.dispatchCall) // wall time: a latency metric
	err := g.runFenced(ctx, func(ctx context.Context, tx pgx.Tx) error {
		out, taken = out[:0], nil
		b := &pgx.Batch{}
		b.Queue(dispatchSQL, g.id, ids, epochs, lims, g.cfg.DispatchBatch)
		if len(cancelIDs) > 0 {
			b.Queue(takeCancelsSQL, g.id, cancelIDs, cancelEpochs)
		}
		br := tx.SendBatch(ctx, b)
		defer br.Close()
		if err := scanDispatched(br, &out); err != nil {
			return err
		}
		if len(cancelIDs) > 0 {
			rows, err := br.Query()
			if err != nil {
				return err
			}
			if taken, err = scanCancels(rows); err != nil {
				return err
			}
		}
		return br.Close()
	})
	if err != nil {
		return nil, 0, err
	}
	timer.ObserveDuration()
	got := make(map[string]int, len(ids))
	var failed []undeliverable
	now := g.clock.Now()
	for _, d := range out {
		got[d.nodeID]++
		g.m.dispatched.Inc()
		g.m.dispatchLatency.Observe(d.latency)
		g.mu.Lock()
		s := g.sessions[d.nodeID]
		g.mu.Unlock()
		if s != nil {
			g.waits.add(waitedForGateway(time.Duration(d.latency*float64(time.Second)), s, now))
		}
		if why := g.undeliverableReason(d.cmd); why != "" {
			failed = append(failed, undeliverable{id: d.cmd.GetCommandId(), nodeID: d.nodeID, epoch: d.epoch, reason: why})
			g.log.Warn("command too large to send; failing it", "node", d.nodeID, "command", d.cmd.GetCommandId(), "reason", why)
			continue
		}
		if s != nil && s.epoch == d.epoch {
			s.sending(now, d.cmd.CommandId)
		}
		sent := s != nil && s.epoch == d.epoch && s.enqueue(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Command{Command: d.cmd}})
		if !sent {
			// The stream ended meanwhile: the command stays dispatched and
			// is replayed on the node's next Hello.
			g.log.Debug("dispatched command has no open stream; it will be replayed", "node", d.nodeID, "command", d.cmd.CommandId)
		}
		g.traceDispatch(ctx, d, start, sent)
	}
	g.deliverCancels(taken)
	if len(failed) > 0 {
		err := g.runFenced(ctx, func(ctx context.Context, tx pgx.Tx) error { return failUndeliverable(ctx, tx, g.id, failed) })
		if err != nil {
			// They stay dispatched and unsent: the next Hello fails them
			// instead of replaying them.
			g.log.Warn("undeliverable commands not failed; the next Hello fails them", "commands", len(failed), "err", err)
		}
	}
	return got, len(out), nil
}

// scanDispatched reads dispatchSQL's rows, the batch's first result, into
// out.
func scanDispatched(br pgx.BatchResults, out *[]dispatched) error {
	rows, err := br.Query()
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var (
			d        dispatched
			c        nodev1.Command
			deadline *time.Time
		)
		if err := rows.Scan(&c.CommandId, &d.nodeID, &d.epoch, &c.Kind, &c.Payload, &deadline, &c.DispatchCount, &d.latency, &d.traceparent); err != nil {
			return err
		}
		if deadline != nil {
			c.Deadline = timestamppb.New(*deadline)
		}
		d.cmd = &c
		*out = append(*out, d)
	}
	return rows.Err()
}

// notifyLoop LISTENs for command wake-ups (coalesced by the creating
// process, pkg/cmdwake) and node spec changes on a dedicated connection and
// wakes dispatch or the spec push for the notified nodes held here. Without
// a notify URL (behind a transaction pooler) both only poll.
func (g *Gateway) notifyLoop(ctx context.Context) {
	if g.notifyURL == "" {
		g.log.Info("command notifications off (no direct database URL); dispatch polls", "interval", g.cfg.DispatchPoll)
		return
	}
	_ = pgnotify.Listen(ctx, pgnotify.Config{
		URL: g.notifyURL,
		Handlers: map[string]func(string){
			pgnotify.Commands: func(payload string) {
				// A list of nodes, or "" for every session.
				nodes := cmdwake.Nodes(payload)
				if nodes == nil {
					g.wakeDispatch("")
					return
				}
				for _, id := range nodes {
					if g.holds(id) {
						g.wakeDispatch(id)
					}
				}
			},
			pgnotify.NodeSpec: func(nodeID string) {
				if g.holds(nodeID) {
					g.wakeSpec(nodeID)
				}
			},
		},
		OnConnect: func() {
			g.wakeDispatch("") // catch up on whatever arrived while not listening
			g.wakeSpec("")
		},
		OnLost: func(err error) {
			g.log.Warn("command notifications lost; polling until reconnected", "err", err)
		},
		Clock: g.clock,
	})
}

// holds reports whether nodeID has a session here.
func (g *Gateway) holds(nodeID string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	_, ok := g.sessions[nodeID]
	return ok
}

// wakeSpec asks the spec loop to compare nodeID's spec ("" compares every
// session's).
func (g *Gateway) wakeSpec(nodeID string) { g.specWaker.wake(nodeID) }

// specLoop pushes NodeSpecUpdate to a session whenever its node's spec is
// newer than the one the node last received: at once when NOTIFY names the
// node, and for every session at each SpecPoll. A push carries the whole
// spec; only the newest version is sent, never an older one.
func (g *Gateway) specLoop(ctx context.Context) {
	g.runWoken(ctx, g.specWaker, g.cfg.SpecPoll, "node spec push", g.pushSpecs)
}

func (g *Gateway) pushSpecs(ctx context.Context, all bool, nodes map[string]struct{}) error {
	var (
		ids      []string
		versions []int64
	)
	g.mu.Lock()
	for id, s := range g.sessions {
		if _, ok := nodes[id]; ok || all {
			ids = append(ids, id)
			versions = append(versions, s.specVersion.Load())
		}
	}
	g.mu.Unlock()
	if len(ids) == 0 {
		return nil
	}
	rows, err := g.db.Query(ctx, newerSpecsSQL, ids, versions)
	if err != nil {
		return fmt.Errorf("read node specs: %w", err)
	}
	type newer struct {
		id      string
		version int64
		raw     []byte
	}
	found, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (newer, error) {
		var n newer
		return n, r.Scan(&n.id, &n.version, &n.raw)
	})
	if err != nil {
		return fmt.Errorf("read node specs: %w", err)
	}
	for _, n := range found {
		g.mu.Lock()
		s := g.sessions[n.id]
		g.mu.Unlock()
		if s == nil {
			continue
		}
		// Only ever move a session's version forward.
		cur := s.specVersion.Load()
		if n.version <= cur || !s.specVersion.CompareAndSwap(cur, n.version) {
			continue
		}
		spec := &nodev1.NodeSpec{}
		if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(n.raw, spec); err != nil {
			g.log.Warn("node spec is not a NodeSpec; not pushed", "node", n.id, "err", err)
			continue
		}
		if s.enqueue(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_NodeSpecUpdate{NodeSpecUpdate: &nodev1.NodeSpecUpdate{Spec: spec}}}) {
			g.m.specPushes.Inc()
		}
	}
	return nil
}

// undeliverable is a command too large to send on a session.
type undeliverable struct {
	id, nodeID string
	epoch      int64
	reason     string
}

// undeliverableReason says why cmd cannot be sent, or "" when it fits: the
// encoded ConnectResponse must fit --gateway.max-message-bytes, which the
// stream enforces at send time by ending the session (before compression
// is counted here, so a command never depends on how well it compresses).
func (g *Gateway) undeliverableReason(cmd *nodev1.Command) string {
	size := proto.Size(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Command{Command: cmd}})
	if size <= g.cfg.MaxMessageBytes {
		return ""
	}
	return fmt.Sprintf("payload of %d bytes does not fit the gateway's --gateway.max-message-bytes %d (the command's message is %d bytes)",
		len(cmd.GetPayload()), g.cfg.MaxMessageBytes, size)
}

// failUndeliverable fails cmds in tx (failUndeliverableSQL).
func failUndeliverable(ctx context.Context, tx pgx.Tx, gatewayID string, cmds []undeliverable) error {
	if len(cmds) == 0 {
		return nil
	}
	ids, nodes, epochs, reasons := make([]string, len(cmds)), make([]string, len(cmds)), make([]int64, len(cmds)), make([]string, len(cmds))
	for i, c := range cmds {
		ids[i], nodes[i], epochs[i], reasons[i] = c.id, c.nodeID, c.epoch, c.reason
	}
	var n int64
	if err := tx.QueryRow(ctx, failUndeliverableSQL, gatewayID, ids, nodes, epochs, reasons).Scan(&n); err != nil {
		return fmt.Errorf("fail %d undeliverable commands: %w", len(cmds), err)
	}
	return nil
}
