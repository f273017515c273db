package fleet

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/pkg/clock"
	"github.com/leasehold/leasehold/pkg/daemon"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// Welcome is one accepted Hello as a node saw it.
type Welcome struct {
	At      time.Time
	Gateway string
	Epoch   int64
}

// Node is one simulated node: a pkg/daemon with bookkeeping.
type Node struct {
	ID string
	D  *daemon.Daemon

	mu         sync.Mutex
	welcomes   []Welcome
	sessionEnd []time.Time
	executed   map[string]int
}

// Sim runs simulated nodes.
type Sim struct {
	Nodes      []*Node
	Executions atomic.Int64
	Duplicates atomic.Int64
	// WorkTime is how long a command takes on a node.
	WorkTime time.Duration
	// Scale, when its Rate is above 1, runs the daemons on the fleet's
	// scaled clock and records every timestamp in simulated time.
	Scale clock.Scale
	wg    sync.WaitGroup
}

// sessionLog records the daemon's "session ended" debug lines, the only
// place the daemon tells when a stream ended.
type sessionLog struct {
	n     *Node
	scale clock.Scale
}

func (h sessionLog) Enabled(_ context.Context, l slog.Level) bool { return true }
func (h sessionLog) Handle(_ context.Context, r slog.Record) error {
	if r.Message == "session ended; redialling" {
		h.n.mu.Lock()
		at := r.Time
		if h.scale.Rate > 1 {
			at = h.scale.Sim(at)
		}
		h.n.sessionEnd = append(h.n.sessionEnd, at)
		h.n.mu.Unlock()
	}
	return nil
}
func (h sessionLog) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h sessionLog) WithGroup(string) slog.Handler      { return h }

// Add creates (does not start) a node daemon dialling address.
func (s *Sim) Add(address, id, credential string, kind nodev1.NodeKind) (*Node, error) {
	n := &Node{ID: id, executed: map[string]int{}}
	clk, err := clock.New(s.Scale)
	if err != nil {
		return nil, err
	}
	d, err := daemon.New(daemon.Config{
		Address: address, NodeID: id, Credential: credential, Kind: kind,
		Logger: slog.New(sessionLog{n, s.Scale}), Clock: clk,
		OnWelcome: func(w *nodev1.Welcome) {
			n.mu.Lock()
			n.welcomes = append(n.welcomes, Welcome{At: clk.Now(), Gateway: w.GetGatewayId(), Epoch: w.GetSessionEpoch()})
			n.mu.Unlock()
		},
		Handler: func(ctx context.Context, cmd *nodev1.Command) daemon.Outcome {
			n.mu.Lock()
			n.executed[cmd.GetCommandId()]++
			dup := n.executed[cmd.GetCommandId()] > 1
			n.mu.Unlock()
			s.Executions.Add(1)
			if dup {
				s.Duplicates.Add(1)
			}
			if s.WorkTime > 0 {
				select {
				case <-ctx.Done():
				case <-time.After(s.WorkTime):
				}
			}
			return daemon.Outcome{Output: []byte("ok")}
		},
	})
	if err != nil {
		return nil, err
	}
	n.D = d
	s.Nodes = append(s.Nodes, n)
	return n, nil
}

// Start runs every node, starting them at most rate per second.
func (s *Sim) Start(ctx context.Context, rate int) {
	for i, n := range s.Nodes {
		s.wg.Add(1)
		go func() { defer s.wg.Done(); _ = n.D.Run(ctx) }()
		if rate > 0 && i%10 == 9 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(10 * time.Second / time.Duration(rate)):
			}
		}
	}
}

// Wait waits for every daemon to return (after ctx is cancelled).
func (s *Sim) Wait() { s.wg.Wait() }

// Connected counts nodes with an open session.
func (s *Sim) Connected() int {
	c := 0
	for _, n := range s.Nodes {
		if n.D.Welcome() != nil {
			c++
		}
	}
	return c
}

// Pushbacks sums the daemons' pushback counts.
func (s *Sim) Pushbacks() int64 {
	var p int64
	for _, n := range s.Nodes {
		p += n.D.Stats().Pushbacks
	}
	return p
}

// Current is the gateway of the node's open session ("" when none).
func (n *Node) Current() string {
	if w := n.D.Welcome(); w != nil {
		return w.GetGatewayId()
	}
	return ""
}

// FirstWelcomeAfter is the first Welcome at or after t.
func (n *Node) FirstWelcomeAfter(t time.Time) (Welcome, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, w := range n.welcomes {
		if !w.At.Before(t) {
			return w, true
		}
	}
	return Welcome{}, false
}

// Welcomes returns a copy of the node's Welcomes.
func (n *Node) Welcomes() []Welcome {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]Welcome(nil), n.welcomes...)
}

// SessionEndsBetween lists the stream ends (pushbacks included) in [a, b).
func (n *Node) SessionEndsBetween(a, b time.Time) []time.Time {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []time.Time
	for _, e := range n.sessionEnd {
		if !e.Before(a) && e.Before(b) {
			out = append(out, e)
		}
	}
	return out
}

// LastSessionEndBefore is the last stream end before t (zero when none).
func (n *Node) LastSessionEndBefore(t time.Time) time.Time {
	n.mu.Lock()
	defer n.mu.Unlock()
	var last time.Time
	for _, e := range n.sessionEnd {
		if e.Before(t) && e.After(last) {
			last = e
		}
	}
	return last
}
