package gateway

import (
	"context"
	"sync"
	"time"
)

// nodeWaker collects the node ids that notifications name and wakes the one
// loop that handles them; "" stands for every session.
type nodeWaker struct {
	mu      sync.Mutex
	pending map[string]struct{}
	ch      chan struct{}
}

func newNodeWaker() *nodeWaker {
	return &nodeWaker{pending: map[string]struct{}{}, ch: make(chan struct{}, 1)}
}

func (w *nodeWaker) wake(nodeID string) {
	w.mu.Lock()
	w.pending[nodeID] = struct{}{}
	w.mu.Unlock()
	select {
	case w.ch <- struct{}{}:
	default:
	}
}

// take returns the pending node ids and whether every session is due.
func (w *nodeWaker) take() (map[string]struct{}, bool) {
	w.mu.Lock()
	nodes := w.pending
	w.pending = map[string]struct{}{}
	w.mu.Unlock()
	_, all := nodes[""]
	return nodes, all
}

// runWoken runs fn for the woken nodes, and for every session at each poll
// (the fallback when notifications are unavailable), until ctx ends; while
// the gateway is fenced it does nothing.
func (g *Gateway) runWoken(ctx context.Context, w *nodeWaker, poll time.Duration, what string,
	fn func(ctx context.Context, all bool, nodes map[string]struct{}) error) {
	t := g.clock.NewTicker(poll)
	defer t.Stop()
	for {
		all := false
		select {
		case <-ctx.Done():
			return
		case <-t.Chan():
			all = true
		case <-w.ch:
		}
		nodes, every := w.take()
		if g.Fenced() {
			continue // serving resumes with a wake of every session
		}
		if err := fn(ctx, all || every, nodes); err != nil && !g.Fenced() && ctx.Err() == nil {
			g.log.Warn(what+" failed", "err", err)
		}
	}
}
