package gateway

// Live output past the stored cap (docs/gateway.md, "Live output"): the
// database keeps the first --gateway.output-cap bytes of a command's output
// for history and resumption; a reader that follows the command live gets
// the rest from the gateway that holds the node's session. The api calls
// WatchOutput on the relay listener; the part past the cap of every piece
// the session's read loop takes from the node is handed to the command's
// watchers, in the node's order: with the stored part, the whole output.
//
// A slow watcher holds the node back for a while, as a slow terminal
// holds back ssh: its queue has watchQueue pieces, and when it is full the
// session's read loop waits up to watchStall for room (HTTP/2 flow control
// then slows the node's sends, and the command's writes). A watcher still
// full after that is ended RESOURCE_EXHAUSTED (the api marks the gap as a
// truncation), so no watcher stalls a session for longer. The command's
// result ends its watchers with the offset after its last byte; the end
// of the node's session ends them UNAVAILABLE.

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/jonboulle/clockwork"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	relayv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/relay/v1"
	"github.com/leasehold/leasehold/pkg/nodeauth"
)

// watchQueue is how many pieces a watcher may have waiting to be relayed
// (the daemon sends 64 KiB pieces: 16 MiB; at most maxOutputPiece each).
const watchQueue = 256

// watchStall is the longest the read loop waits for a full watcher.
const watchStall = time.Second

// maxFinishedOutputs bounds the final output offsets a session remembers
// for commands whose result it has read.
const maxFinishedOutputs = 1024

// outputWatch is one WatchOutput call.
type outputWatch struct {
	s       *session
	command string
	// ch carries the pieces and is never closed; ended is closed when the
	// watch ends, after every piece it gets was put in ch.
	ch    chan *nodev1.CommandOutput
	ended chan struct{}

	// Under outputWatchers.mu: closed says ended is closed; err is why
	// (nil: the result arrived, and end is the offset after the last byte).
	closed bool
	err    *connect.Error
	end    int64
}

// outputWatchers are the gateway's WatchOutput calls by command id.
type outputWatchers struct {
	clock clockwork.Clock
	n     atomic.Int64 // watches registered
	mu    sync.Mutex
	by    map[string]map[*outputWatch]struct{}
	// kept is the output past the cap kept for late watchers, keptBytes
	// its size (watchkeep.go).
	kept      map[string]*keptOutput
	keptBytes int64
}

// add registers a watch of command on s, its queue primed with what s
// kept of the command's output (in order, before any live piece).
func (o *outputWatchers) add(s *session, command string) *outputWatch {
	o.mu.Lock()
	defer o.mu.Unlock()
	var kept []*nodev1.CommandOutput
	if k := o.kept[command]; k != nil && k.s == s {
		kept = k.pieces
	}
	w := &outputWatch{s: s, command: command, ch: make(chan *nodev1.CommandOutput, watchQueue+len(kept)), ended: make(chan struct{})}
	for _, p := range kept {
		w.ch <- p
	}
	if o.by == nil {
		o.by = make(map[string]map[*outputWatch]struct{})
	}
	set := o.by[command]
	if set == nil {
		set = make(map[*outputWatch]struct{})
		o.by[command] = set
	}
	set[w] = struct{}{}
	o.n.Add(1)
	return w
}

// remove unregisters w (when its call returns).
func (o *outputWatchers) remove(w *outputWatch) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.endLocked(w, connect.NewError(connect.CodeCanceled, fmt.Errorf("watch of command %s ended", w.command)), 0)
	if set := o.by[w.command]; set != nil {
		if _, ok := set[w]; ok {
			delete(set, w)
			o.n.Add(-1)
		}
		if len(set) == 0 {
			delete(o.by, w.command)
		}
	}
}

// endLocked ends w once: err nil means the output ended at end.
func (o *outputWatchers) endLocked(w *outputWatch, err *connect.Error, end int64) {
	if w.closed {
		return
	}
	w.closed, w.err, w.end = true, err, end
	close(w.ended)
}

// outcome is why w ended (nil: the output ended at end).
func (o *outputWatchers) outcome(w *outputWatch) (*connect.Error, int64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return w.err, w.end
}

// publish keeps a piece read on s for later watchers (watchkeep.go) and
// hands it to the watchers of its command on s. A
// full watcher is waited for up to watchStall (with the session marked
// held back, so it is not taken for dead), then ended.
func (o *outputWatchers) publish(ctx context.Context, s *session, p *nodev1.CommandOutput) {
	var full []*outputWatch
	o.mu.Lock()
	o.keepLocked(s, p)
	for w := range o.by[p.GetCommandId()] {
		if w.s != s || w.closed {
			continue
		}
		select {
		case w.ch <- p:
		default:
			full = append(full, w)
		}
	}
	o.mu.Unlock()
	for _, w := range full {
		if o.stall(ctx, s, w, p) {
			continue
		}
		o.mu.Lock()
		o.endLocked(w, connect.NewError(connect.CodeResourceExhausted,
			fmt.Errorf("the watcher of command %s fell more than %d pieces behind at offset %d", p.GetCommandId(), watchQueue, p.GetOffset())), 0)
		o.mu.Unlock()
	}
}

// stall waits up to watchStall for room in w's queue and says whether p
// went in (or w ended meanwhile, which needs nothing more).
func (o *outputWatchers) stall(ctx context.Context, s *session, w *outputWatch, p *nodev1.CommandOutput) bool {
	s.heldBack.Store(true)
	defer s.heldBack.Store(false)
	t := o.clock.NewTimer(watchStall)
	defer t.Stop()
	select {
	case w.ch <- p:
		return true
	case <-w.ended:
		return true
	case <-ctx.Done():
		return false
	case <-t.Chan():
		return false
	}
}

// finish ends the watchers of command on s: its output ended at end.
func (o *outputWatchers) finish(s *session, command string, end int64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.keptFinishedLocked(s, command)
	for w := range o.by[command] {
		if w.s == s {
			o.endLocked(w, nil, end)
		}
	}
}

// finishOne ends w alone: its command's output ended at end.
func (o *outputWatchers) finishOne(w *outputWatch, end int64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.endLocked(w, nil, end)
}

// endSession ends every watcher on s, whose stream closed.
func (o *outputWatchers) endSession(s *session) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.keptSessionEndedLocked(s)
	for _, set := range o.by {
		for w := range set {
			if w.s == s {
				o.endLocked(w, connect.NewError(connect.CodeUnavailable,
					fmt.Errorf("node %s's session closed; watch again once it has reconnected", s.nodeID)), 0)
			}
		}
	}
}

// outputRead records that s read output of command up to end (read loop).
func (s *session) outputRead(command string, end int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.outputEnd == nil {
		s.outputEnd = make(map[string]int64)
	}
	if end > s.outputEnd[command] {
		s.outputEnd[command] = end
	}
}

// outputFinished moves command's output end to the finished ones (its
// result was read) and returns it.
func (s *session) outputFinished(command string) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	end, ok := s.outputEnd[command]
	if prev, seen := s.finishedOutput[command]; !ok && seen {
		return prev // a result sent again
	}
	delete(s.outputEnd, command)
	if len(s.finishedOutput) >= maxFinishedOutputs {
		clear(s.finishedOutput)
	}
	if s.finishedOutput == nil {
		s.finishedOutput = make(map[string]int64)
	}
	s.finishedOutput[command] = end
	return end
}

// finishedOutputEnd is where command's output ended, if s read its result.
func (s *session) finishedOutputEnd(command string) (int64, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	end, ok := s.finishedOutput[command]
	return end, ok
}

type watchStream = connect.ServerStream[relayv1.WatchOutputResponse]

// WatchOutput relays the live output of a command on a node whose session
// this gateway holds (GatewayRelayService).
func (g *Gateway) WatchOutput(ctx context.Context, req *connect.Request[relayv1.WatchOutputRequest], stream *watchStream) error {
	if g.state.Load() != stateServing {
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("gateway %s is not serving; watch again", g.id))
	}
	node, command := req.Msg.GetNodeId(), req.Msg.GetCommandId()
	if err := nodeauth.ValidateNodeID(node); err != nil {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("node_id: %w", err))
	}
	if command == "" || len(command) > maxIDLen {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("command_id must be 1..%d bytes", maxIDLen))
	}
	g.mu.Lock()
	s := g.sessions[node]
	g.mu.Unlock()
	if s == nil {
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("node %s has no session on gateway %s", node, g.id))
	}
	w := g.watchers.add(s, command)
	defer g.watchers.remove(w)
	// Registered first, then checked: a result or a close that came
	// before the registration is seen here, one after it ends w.
	if s.isClosed() {
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("node %s's session on gateway %s closed", node, g.id))
	}
	if end, ok := s.finishedOutputEnd(command); ok {
		g.watchers.finishOne(w, end)
	}
	if err := stream.Send(&relayv1.WatchOutputResponse{Watching: true}); err != nil {
		return err
	}
	send := func(p *nodev1.CommandOutput) error {
		if err := stream.Send(&relayv1.WatchOutputResponse{Offset: p.GetOffset(), Stream: p.GetStream(), Data: p.GetData()}); err != nil {
			return err
		}
		g.m.outputRelayed.Add(float64(len(p.GetData())))
		return nil
	}
	for {
		select {
		case <-ctx.Done():
			return connect.NewError(connect.CodeCanceled, ctx.Err())
		case p := <-w.ch:
			if err := send(p); err != nil {
				return err
			}
		case <-w.ended:
			err, end := g.watchers.outcome(w)
			if err != nil {
				if err.Code() == connect.CodeResourceExhausted {
					g.m.watchersLagged.Inc()
				}
				return err
			}
			for { // every piece was queued before the end
				select {
				case p := <-w.ch:
					if err := send(p); err != nil {
						return err
					}
				default:
					return stream.Send(&relayv1.WatchOutputResponse{End: true, Offset: end})
				}
			}
		}
	}
}
