package gateway

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sync/semaphore"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// maxQueued bounds the messages waiting for a slow node; past it the session
// is closed and its commands are replayed on the next Hello.
const maxQueued = 1024

// session is one node's stream on this gateway. Messages to the node go
// through a bounded FIFO, so dispatch never blocks on a slow node and Sends
// never overlap. Who sends depends on the server:
//
//   - inline (the lean server, whose request body can say when it is
//     readable): the handler goroutine itself waits for either the body or
//     the queue, then Receives or Sends. An idle session costs the handler
//     goroutine only.
//   - otherwise (net/http): the handler blocks in Receive and a writer
//     goroutine, which exists only while the queue is not empty, Sends.
//
// A session is closed from outside by closing the request body, which breaks
// the pending Receive (or wakes the inline wait); the handler then returns
// the recorded reason.
type session struct {
	nodeID string
	epoch  int64
	// generation is the gateway's fence count when the Hello began.
	generation uint64
	send       func(*nodev1.ConnectResponse) error
	// breakRecv unblocks the handler's Receive; stopWaits ends the waits
	// of its read loop (the output budget), set by serveSession.
	breakRecv func()
	stopWaits context.CancelFunc

	lastRecv atomic.Int64 // unix nanos of the last message from the node
	// roomAt is when the node's window last had room after being full (or
	// the session began), in unix nanos of the gateway clock: a command of
	// this node waited for dispatch, not for its node, only since then
	// (load.go).
	roomAt atomic.Int64
	// skew is the node's clock minus the database's in nanoseconds, from
	// its last heartbeat (noSkew before one; skew.go).
	skew atomic.Int64
	// specVersion is the nodes.spec_version the node last received (in
	// Welcome or a NodeSpecUpdate).
	specVersion atomic.Int64

	// inline: the handler sends; wake (capacity 1) tells it the queue
	// has messages.
	inline bool
	wake   chan struct{}

	// heldAtHello holds the commands the node's Hello listed as in flight
	// on the node, until registerSession has counted the replays.
	heldAtHello map[string]struct{}

	// window bounds inflight (Config.NodeWindow).
	window int
	// reports bounds the results read from the node and not yet answered
	// by the group commit, weighted by size (reportWeight): the read loop
	// goes on reading while they commit, within reportBudget bytes.
	reports      *semaphore.Weighted
	reportBudget int64
	// output bounds the live output bytes queued for the group commit
	// and not yet answered (sessionOutputBudget); heldBack is set while
	// the read loop waits for it. marked holds the commands whose
	// truncation marker is queued (read loop only).
	output   *semaphore.Weighted
	heldBack atomic.Bool
	marked   map[string]struct{}

	mu    sync.Mutex
	queue []*nodev1.ConnectResponse
	// inflight holds the commands sent (or queued to send) on this
	// session that the node has not answered with a result, each with
	// when it was sent (unix nanos of the gateway clock), 0 once the node
	// has acknowledged it.
	inflight map[string]int64
	// outputEnd is the offset after the last output byte read per
	// command; finishedOutput the same for commands whose result was read
	// (bounded; watch.go).
	outputEnd, finishedOutput map[string]int64

	writing  bool
	writerCh chan struct{} // closed when the current writer exits
	closed   bool
	reason   *connect.Error
}

func (s *session) touch(now time.Time) { s.lastRecv.Store(now.UnixNano()) }

func (s *session) lastSeen() time.Time { return time.Unix(0, s.lastRecv.Load()) }

// enqueue queues msg for the node; false when the session is closed.
func (s *session) enqueue(msgs ...*nodev1.ConnectResponse) bool {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return false
	}
	if len(s.queue)+len(msgs) > maxQueued {
		s.mu.Unlock()
		s.close(connect.NewError(connect.CodeResourceExhausted, errSlowNode))
		return false
	}
	s.queue = append(s.queue, msgs...)
	if s.inline {
		s.mu.Unlock()
		select {
		case s.wake <- struct{}{}:
		default:
		}
		return true
	}
	if !s.writing {
		s.writing = true
		s.writerCh = make(chan struct{})
		go s.write(s.writerCh)
	}
	s.mu.Unlock()
	return true
}

// write is the writer goroutine of a session on net/http's server; it
// closes done when it exits.
func (s *session) write(done chan struct{}) {
	defer close(done)
	_ = s.drain(func() { s.writing, s.queue = false, nil })
}

// sendQueued sends the queued messages from the handler goroutine (inline
// sessions); an error means the stream failed and the session is closed.
func (s *session) sendQueued() error { return s.drain(func() {}) }

// drain sends queued messages until the queue is empty, the session is
// closed or a Send fails (then it closes the session and returns the
// error). stop runs under s.mu as draining ends, so an enqueue sees the
// writer's exit atomically with the empty queue.
func (s *session) drain(stop func()) error {
	for {
		s.mu.Lock()
		if s.closed || len(s.queue) == 0 {
			if len(s.queue) == 0 {
				s.queue = nil
			}
			stop()
			s.mu.Unlock()
			return nil
		}
		msg := s.queue[0]
		s.queue[0] = nil
		s.queue = s.queue[1:]
		s.mu.Unlock()
		if err := s.send(msg); err != nil {
			s.close(nil)
			s.mu.Lock()
			stop()
			s.mu.Unlock()
			return err
		}
	}
}

// close ends the session with reason (nil: the stream itself failed). Only
// the first close counts.
func (s *session) close(reason *connect.Error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	s.reason = reason
	s.mu.Unlock()
	s.breakRecv()
	if s.stopWaits != nil {
		s.stopWaits()
	}
}

// finish marks the session closed, waits for the writer to stop and returns
// the close reason. The handler calls it before returning, so no Send runs
// after the handler has returned.
func (s *session) finish() *connect.Error {
	s.mu.Lock()
	s.closed = true
	if s.inline {
		s.queue = nil
	}
	ch := s.writerCh
	writing := s.writing
	reason := s.reason
	s.mu.Unlock()
	if writing {
		<-ch
	}
	return reason
}

// room is how many more commands dispatch may send the node: no more than
// its window less the commands it holds unanswered, and no more than half
// of maxQueued less what is queued, so a node that reads or runs slowly is
// held back by dispatch (its commands stay pending, visible and cheap to
// pick later) instead of being flooded or closed as a slow node.
// windowFull says the window, not the queue, is what stops it.
func (s *session) room() (n int, windowFull bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	w := s.window - len(s.inflight)
	return min(maxQueued/2-len(s.queue), w), w <= 0
}

// reportWeight is what a result of size bytes takes of the session's
// report budget: its size, but at least budget/window, so no more than
// window small results are outstanding, and at most the whole budget, so
// one result as large as a message still fits.
func reportWeight(size int, budget int64, window int) int64 {
	return min(max(int64(size)+512, budget/int64(max(window, 1))), budget)
}

// settled waits until every result read from the node before this call
// has been answered by the group commit (or ctx ends).
func (s *session) settled(ctx context.Context) error {
	if err := s.reports.Acquire(ctx, s.reportBudget); err != nil {
		return err
	}
	s.reports.Release(s.reportBudget)
	return nil
}

// sending counts commands into the window, sent at now, before they are
// queued, so a result that overtakes the enqueue still finds them. A
// command sent again (a replay, a re-dispatch) counts once.
func (s *session) sending(now time.Time, ids ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.inflight == nil {
		s.inflight = make(map[string]int64, len(ids))
	}
	for _, id := range ids {
		if _, ok := s.inflight[id]; !ok {
			s.inflight[id] = now.UnixNano()
		}
	}
}

// acknowledged records that the node holds a command in its window (its
// ack, or its Hello listing it); an unknown id changes nothing.
func (s *session) acknowledged(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.inflight[id]; ok {
		s.inflight[id] = 0
	}
}

// queueIsGateways says whether what is pending for the node waits for the
// gateway rather than for the node (load.go): its window has room, which
// dispatch should fill, or it holds a command sent more than grace before
// now and not acknowledged, an ack the gateway has not read. A window full
// of commands the node acknowledged, or was sent a moment ago, means the
// node is running what it was given: its queue is its own.
func (s *session) queueIsGateways(now time.Time, grace time.Duration) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.inflight) < s.window {
		return true
	}
	before := now.Add(-grace).UnixNano()
	for _, sent := range s.inflight {
		if sent != 0 && sent < before {
			return true
		}
	}
	return false
}

// answered takes a command out of the window (its result, or a cancel
// ack, arrived at now) and says whether the window had been full, so the
// caller wakes dispatch for the node; a window that was full records now
// as roomAt. An unknown id changes nothing.
func (s *session) answered(id string, now time.Time) (wasFull bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.inflight[id]; !ok {
		return false
	}
	wasFull = len(s.inflight) >= s.window
	delete(s.inflight, id)
	if wasFull {
		s.roomAt.Store(now.UnixNano())
	}
	return wasFull
}

func (s *session) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}
