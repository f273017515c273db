package gateway

// Tunnels (docs/gateway.md, "Tunnels"): the api opens RelayTunnel on this
// gateway's relay listener for a node whose session this gateway holds; the
// gateway sends OpenTunnel on the node's session stream, and the daemon
// connects the target and opens a Tunnel stream back, on the same
// connection, carrying the tunnel id and a one-time token. The two streams
// are paired by tunnel id and relayed: each direction reads one message,
// writes it, then reads the next, so HTTP/2 flow control on both sides is
// the only buffer and a slow side slows the other down. A tunnel holds no
// state anywhere else: it dies with this gateway or the node's session and
// the caller opens a new one. A shell's terminal size and TERM ride the
// OpenTunnel; resizes go to the daemon and the shell's exit status comes
// back in order with the bytes.

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	"github.com/leasehold/leasehold/pkg/audit"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	relayv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/relay/v1"
	"github.com/leasehold/leasehold/pkg/nodeauth"
)

// maxTunnelChunk is the most bytes one tunnel data message may carry.
const maxTunnelChunk = 64 << 10

// tunnelEndWait bounds how long a finished tunnel waits for its copy
// goroutines once both streams have been broken.
const tunnelEndWait = 5 * time.Second

type (
	relayStream  = connect.BidiStream[relayv1.RelayTunnelRequest, relayv1.RelayTunnelResponse]
	daemonStream = connect.BidiStream[nodev1.TunnelRequest, nodev1.TunnelResponse]
)

// tunnel is one open tunnel, registered from the relay's request until it
// ends.
type tunnel struct {
	id, nodeID string
	token      []byte
	sess       *session
	// attached receives the daemon's side once (capacity 1).
	attached chan *daemonSide

	killOnce sync.Once
	killed   chan struct{}
	killErr  *connect.Error

	// toNode and fromNode count the bytes relayed, for the close's audit
	// row; shellExit is how the node said its shell ended.
	toNode, fromNode atomic.Int64
	shellExit        atomic.Pointer[nodev1.ShellExit]
}

// kill ends the tunnel with err; only the first kill counts.
func (t *tunnel) kill(err *connect.Error) {
	t.killOnce.Do(func() { t.killErr = err; close(t.killed) })
}

// daemonSide is the daemon's Tunnel stream, held open by its handler until
// done is closed.
type daemonSide struct {
	stream    *daemonStream
	attach    *nodev1.TunnelAttach
	breakRecv func()
	done      chan struct{}
	err       error // set before done is closed
}

// tunnelTable is the gateway's open tunnels and their counts.
type tunnelTable struct {
	mu     sync.Mutex
	byID   map[string]*tunnel
	byNode map[string]int
}

// reserveTunnel registers t unless a limit is reached; the error names the
// limit. releaseTunnel gives the slot back.
func (g *Gateway) reserveTunnel(t *tunnel) *connect.Error {
	tt := &g.tunnels
	tt.mu.Lock()
	defer tt.mu.Unlock()
	if n := tt.byNode[t.nodeID]; n >= g.cfg.MaxTunnelsPerNode {
		g.m.tunnelsRefused.WithLabelValues("max-tunnels-per-node").Inc()
		return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("node %s has %d tunnels open on gateway %s: the limit --gateway.max-tunnels-per-node is %d",
			t.nodeID, n, g.id, g.cfg.MaxTunnelsPerNode))
	}
	if len(tt.byID) >= g.cfg.MaxTunnels {
		g.m.tunnelsRefused.WithLabelValues("max-tunnels").Inc()
		return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("gateway %s has %d tunnels open: the limit --gateway.max-tunnels is %d",
			g.id, len(tt.byID), g.cfg.MaxTunnels))
	}
	tt.byID[t.id] = t
	tt.byNode[t.nodeID]++
	g.m.tunnelsOpen.Set(float64(len(tt.byID)))
	return nil
}

func (g *Gateway) releaseTunnel(t *tunnel) {
	tt := &g.tunnels
	tt.mu.Lock()
	defer tt.mu.Unlock()
	delete(tt.byID, t.id)
	if tt.byNode[t.nodeID]--; tt.byNode[t.nodeID] <= 0 {
		delete(tt.byNode, t.nodeID)
	}
	g.m.tunnelsOpen.Set(float64(len(tt.byID)))
}

// tunnelCount is the number of tunnels attaching or open.
func (g *Gateway) tunnelCount() int {
	g.tunnels.mu.Lock()
	defer g.tunnels.mu.Unlock()
	return len(g.tunnels.byID)
}

// killTunnelsOf ends the tunnels riding session s (its stream ended).
func (g *Gateway) killTunnelsOf(s *session, why string) {
	tt := &g.tunnels
	tt.mu.Lock()
	var victims []*tunnel
	for _, t := range tt.byID {
		if t.sess == s {
			victims = append(victims, t)
		}
	}
	tt.mu.Unlock()
	for _, t := range victims {
		t.kill(connect.NewError(connect.CodeUnavailable, fmt.Errorf("tunnel %s ended: the session of node %s on gateway %s ended (%s); open a new tunnel", t.id, t.nodeID, g.id, why)))
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// validateRelayOpen checks the relay's first message, naming the field.
func validateRelayOpen(o *relayv1.RelayOpen) error {
	if o == nil {
		return errors.New("open: the first message must name node_id and target")
	}
	if err := nodeauth.ValidateNodeID(o.GetNodeId()); err != nil {
		return fmt.Errorf("open.node_id: %w", err)
	}
	switch k := o.GetTarget().GetKind().(type) {
	case *controlv1.TunnelTarget_Port:
		if k.Port < 1 || k.Port > 65535 {
			return fmt.Errorf("open.target.port %d must be in 1..65535", k.Port)
		}
	case *controlv1.TunnelTarget_Shell:
		if !k.Shell {
			return errors.New("open.target.shell must be true when set")
		}
	default:
		return errors.New("open.target must set port or shell")
	}
	_, shell := o.GetTarget().GetKind().(*controlv1.TunnelTarget_Shell)
	if sz := o.GetTerminalSize(); sz != nil {
		if !shell {
			return errors.New("open.terminal_size: only a shell runs on a terminal")
		}
		if err := checkTerminalSize(sz); err != nil {
			return fmt.Errorf("open.terminal_size: %w", err)
		}
	}
	if t := o.GetTerm(); t != "" {
		if o.GetTerminalSize() == nil {
			return errors.New("open.term: set only with open.terminal_size")
		}
		if err := checkTerm(t); err != nil {
			return fmt.Errorf("open.term: %w", err)
		}
	}
	return nil
}

// maxTerminalCells bounds a terminal's rows and cols.
const maxTerminalCells = 10000

// checkTerminalSize says why sz is not a terminal size, if it is not.
func checkTerminalSize(sz *nodev1.TerminalSize) error {
	if sz.GetRows() < 1 || sz.GetRows() > maxTerminalCells || sz.GetCols() < 1 || sz.GetCols() > maxTerminalCells {
		return fmt.Errorf("%dx%d: rows and cols must be in 1..%d", sz.GetRows(), sz.GetCols(), maxTerminalCells)
	}
	return nil
}

// checkTerm says why t is not a terminal name (1..64 bytes of
// [A-Za-z0-9._+-]), if it is not.
func checkTerm(t string) error {
	if len(t) > 64 {
		return fmt.Errorf("%d bytes, more than 64", len(t))
	}
	for _, c := range []byte(t) {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_', c == '+', c == '-':
		default:
			return fmt.Errorf("%q is not a terminal name ([A-Za-z0-9._+-])", t)
		}
	}
	return nil
}

// RelayTunnel serves the api's side of a tunnel (relayv1connect.GatewayRelayServiceHandler).
func (g *Gateway) RelayTunnel(ctx context.Context, api *relayStream) error {
	if g.state.Load() != stateServing {
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("gateway %s is not serving; open the tunnel again", g.id))
	}
	first, err := api.Receive()
	if err != nil {
		return receiveError(err)
	}
	open := first.GetOpen()
	if err := validateRelayOpen(open); err != nil {
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	g.mu.Lock()
	s := g.sessions[open.GetNodeId()]
	g.mu.Unlock()
	if s == nil || s.isClosed() {
		g.m.tunnelsRefused.WithLabelValues("no-session").Inc()
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("node %s has no session on gateway %s; retry once it has reconnected", open.GetNodeId(), g.id))
	}
	t := &tunnel{id: randomHex(12), nodeID: open.GetNodeId(), sess: s, attached: make(chan *daemonSide, 1), killed: make(chan struct{})}
	t.token = make([]byte, 32)
	_, _ = rand.Read(t.token)
	if cerr := g.reserveTunnel(t); cerr != nil {
		return cerr
	}
	defer g.releaseTunnel(t)
	defer t.kill(connect.NewError(connect.CodeCanceled, fmt.Errorf("tunnel %s ended", t.id)))
	msg := &nodev1.OpenTunnel{TunnelId: t.id, Token: t.token, TerminalSize: open.GetTerminalSize(), Term: open.GetTerm()}
	switch k := open.GetTarget().GetKind().(type) {
	case *controlv1.TunnelTarget_Port:
		msg.Target = &nodev1.OpenTunnel_Port{Port: k.Port}
	case *controlv1.TunnelTarget_Shell:
		msg.Target = &nodev1.OpenTunnel_Shell{Shell: true}
	}
	if !s.enqueue(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_OpenTunnel{OpenTunnel: msg}}) {
		g.m.tunnelsRefused.WithLabelValues("no-session").Inc()
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("node %s's session on gateway %s ended; retry once it has reconnected", t.nodeID, g.id))
	}
	log := g.log.With("tunnel", t.id, "node", t.nodeID, "actor", open.GetActor(), "caller", g.relayAuth.peer())

	timer := g.clock.NewTimer(g.cfg.TunnelAttachTimeout)
	var d *daemonSide
	select {
	case d = <-t.attached:
		timer.Stop()
	case <-timer.Chan():
		g.m.tunnelsRefused.WithLabelValues("attach-timeout").Inc()
		return connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("node %s did not attach tunnel %s within %s (--gateway.tunnel-attach-timeout; does its daemon support tunnels?)",
			t.nodeID, t.id, g.cfg.TunnelAttachTimeout))
	case <-t.killed:
		timer.Stop()
		g.m.tunnelsRefused.WithLabelValues("no-session").Inc()
		return t.killErr
	case <-ctx.Done():
		timer.Stop()
		return connect.NewError(connect.CodeCanceled, ctx.Err())
	}
	if code := d.attach.GetErrorCode(); code != 0 {
		d.finish(nil)
		g.m.tunnelsRefused.WithLabelValues("node").Inc()
		c := connect.Code(code)
		if c < connect.CodeCanceled || c > connect.CodeUnauthenticated {
			c = connect.CodeUnknown
		}
		return connect.NewError(c, fmt.Errorf("node %s refused the tunnel: %s", t.nodeID, d.attach.GetErrorMessage()))
	}
	ra := relayAudit{actor: open.GetActor(), caller: g.relayAuth.peer(), target: tunnelTarget(open), tunnel: t}
	if err := g.auditRelay(ctx, ra, "relay.open", nil); err != nil {
		d.finish(connect.NewError(connect.CodeUnavailable, errors.New("the tunnel could not be audited")))
		log.Error("tunnel refused: its audit row could not be written", "err", err)
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("tunnel %s: its audit row could not be written; retry", t.id))
	}
	if err := api.Send(&relayv1.RelayTunnelResponse{Opened: &controlv1.TunnelOpened{TunnelId: t.id, GatewayId: g.id}}); err != nil {
		d.finish(connect.NewError(connect.CodeCanceled, errors.New("the caller went away")))
		g.auditRelayClose(ctx, ra, err, log)
		return err
	}
	g.m.tunnelsOpened.Inc()
	log.Info("tunnel open")
	err = g.relay(ctx, t, api, d)
	log.Info("tunnel closed", "err", err)
	g.auditRelayClose(ctx, ra, err, log)
	return err
}

// relayAudit is what a relay tunnel's audit rows say: the actor the api
// named, how the relay's caller was authenticated, the target.
type relayAudit struct {
	actor, caller, target string
	tunnel                *tunnel
}

// auditRelay writes one audit row of a relay tunnel (relay.open or
// relay.close), so every tunnel opened on the relay is on the audit trail
// whoever opened it, beside the api's own tunnel.open/tunnel.close rows.
// Audit rows are facts: not fenced on the gateway lease.
func (g *Gateway) auditRelay(ctx context.Context, ra relayAudit, method string, extra map[string]any) error {
	detail := map[string]any{"tunnel_id": ra.tunnel.id, "gateway": g.id, "target": ra.target, "caller": ra.caller}
	maps.Copy(detail, extra)
	outcome := "ok"
	if code, ok := extra["code"].(string); ok {
		outcome = code
		delete(detail, "code")
	}
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	return audit.Record(actx, g.db, audit.Event{Actor: ra.actor, Role: "relay", Method: method, TargetKind: "node", TargetID: ra.tunnel.nodeID,
		Outcome: outcome, Detail: detail})
}

// auditRelayClose records a relay tunnel's end: bytes each way, how its
// shell ended, and the error that ended it.
func (g *Gateway) auditRelayClose(ctx context.Context, ra relayAudit, failure error, log *slog.Logger) {
	extra := map[string]any{"bytes_to_node": ra.tunnel.toNode.Load(), "bytes_from_node": ra.tunnel.fromNode.Load()}
	if se := ra.tunnel.shellExit.Load(); se != nil {
		extra["shell_exit_code"] = se.GetExitCode()
		if sig := se.GetSignal(); sig != "" {
			extra["shell_signal"] = audit.Short(sig)
		}
	}
	if failure != nil {
		extra["code"] = connect.CodeOf(failure).String()
		extra["error"] = audit.Short(failure.Error())
	}
	if err := g.auditRelay(ctx, ra, "relay.close", extra); err != nil {
		log.Error("audit relay close", "err", err)
	}
}

// tunnelTarget words a relay open's target as the api's audit rows do.
func tunnelTarget(open *relayv1.RelayOpen) string {
	switch k := open.GetTarget().GetKind().(type) {
	case *controlv1.TunnelTarget_Port:
		return fmt.Sprintf("port:%d", k.Port)
	case *controlv1.TunnelTarget_Shell:
		return "shell"
	}
	return ""
}

// finish ends the daemon's Tunnel handler with err (nil: a clean end).
func (d *daemonSide) finish(err error) {
	d.err = err
	close(d.done)
}

// relay copies both ways until both directions ended, one side failed, the
// tunnel was killed or went idle.
func (g *Gateway) relay(ctx context.Context, t *tunnel, api *relayStream, d *daemonSide) error {
	var last atomic.Int64
	touch := func() { last.Store(g.clock.Now().UnixNano()) }
	touch()
	type result struct {
		dir string
		err error
	}
	results := make(chan result, 2)
	apiBody, _ := ctx.Value(bodyKey{}).(io.Closer)

	// api -> daemon
	go func() {
		for {
			m, err := api.Receive()
			if errors.Is(err, io.EOF) {
				results <- result{"to_node", d.stream.Send(&nodev1.TunnelResponse{Eof: true})}
				return
			}
			if err != nil {
				results <- result{"to_node", connect.NewError(connect.CodeCanceled, fmt.Errorf("the caller's side ended: %w", err))}
				return
			}
			if len(m.GetData()) > maxTunnelChunk {
				results <- result{"to_node", connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("data: %d bytes, more than %d per message", len(m.GetData()), maxTunnelChunk))}
				return
			}
			if rs := m.GetResize(); rs != nil {
				if err := checkTerminalSize(rs); err != nil {
					results <- result{"to_node", connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("resize: %w", err))}
					return
				}
			}
			if len(m.GetData()) == 0 && m.GetResize() == nil {
				continue
			}
			touch()
			if err := d.stream.Send(&nodev1.TunnelResponse{Data: m.GetData(), Resize: m.GetResize()}); err != nil {
				results <- result{"to_node", connect.NewError(connect.CodeUnavailable, fmt.Errorf("node %s's tunnel stream failed: %w", t.nodeID, err))}
				return
			}
			g.m.tunnelBytes.WithLabelValues("to_node").Add(float64(len(m.GetData())))
			t.toNode.Add(int64(len(m.GetData())))
		}
	}()
	// daemon -> api
	go func() {
		for {
			m, err := d.stream.Receive()
			if errors.Is(err, io.EOF) {
				results <- result{"from_node", api.Send(&relayv1.RelayTunnelResponse{Eof: true})}
				return
			}
			if err != nil {
				results <- result{"from_node", connect.NewError(connect.CodeUnavailable, fmt.Errorf("node %s's tunnel stream ended: %w", t.nodeID, err))}
				return
			}
			if len(m.GetData()) > maxTunnelChunk {
				results <- result{"from_node", connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("node %s sent %d bytes in one tunnel message, more than %d", t.nodeID, len(m.GetData()), maxTunnelChunk))}
				return
			}
			// Bytes on a Tunnel stream come over the node's session
			// connection: the node is alive even while its heartbeats wait
			// behind them (or behind this gateway's own work), so they
			// count for the session's liveness too.
			t.sess.touch(g.clock.Now())
			if len(m.GetData()) == 0 && m.GetShellExit() == nil {
				continue
			}
			if se := m.GetShellExit(); se != nil {
				t.shellExit.Store(se)
			}
			touch()
			if err := api.Send(&relayv1.RelayTunnelResponse{Data: m.GetData(), ShellExit: m.GetShellExit()}); err != nil {
				results <- result{"from_node", connect.NewError(connect.CodeCanceled, fmt.Errorf("the caller's side failed: %w", err))}
				return
			}
			g.m.tunnelBytes.WithLabelValues("from_node").Add(float64(len(m.GetData())))
			t.fromNode.Add(int64(len(m.GetData())))
		}
	}()

	idle := g.clock.NewTicker(max(g.cfg.TunnelIdleTimeout/4, 10*time.Millisecond))
	defer idle.Stop()
	var (
		ended   int
		failure error
	)
	for ended < 2 && failure == nil {
		select {
		case r := <-results:
			ended++
			if r.err != nil {
				failure = r.err
			}
		case <-t.killed:
			failure = t.killErr
		case <-ctx.Done():
			// The api reset its relay stream (its caller went away): with
			// the caller's side already half-closed and a silent node,
			// nothing else would notice.
			failure = connect.NewError(connect.CodeCanceled, fmt.Errorf("tunnel %s: the caller's side went away", t.id))
		case <-idle.Chan():
			if g.clock.Since(time.Unix(0, last.Load())) >= g.cfg.TunnelIdleTimeout {
				g.m.tunnelsIdle.Inc()
				failure = connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("tunnel %s carried no byte for %s (--gateway.tunnel-idle-timeout); open a new one", t.id, g.cfg.TunnelIdleTimeout))
			}
		}
	}
	if failure != nil {
		// Break both pending Receives; the handlers' returns end the Sends.
		d.breakRecv()
		if apiBody != nil {
			_ = apiBody.Close()
		}
		wait := g.clock.NewTimer(tunnelEndWait)
		for ; ended < 2; ended++ {
			select {
			case <-results:
			case <-wait.Chan():
				ended = 2
			}
		}
		wait.Stop()
	}
	d.finish(failure)
	return failure
}

// Tunnel serves the daemon's side of a tunnel (nodev1connect.NodeGatewayServiceHandler).
func (g *Gateway) Tunnel(ctx context.Context, stream *daemonStream) error {
	first, err := stream.Receive()
	if err != nil {
		return receiveError(err)
	}
	a := first.GetAttach()
	if a == nil || a.GetTunnelId() == "" || len(a.GetTunnelId()) > maxIDLen {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("attach.tunnel_id: the first message must be an attach with a tunnel id of 1..%d bytes", maxIDLen))
	}
	g.tunnels.mu.Lock()
	t := g.tunnels.byID[a.GetTunnelId()]
	g.tunnels.mu.Unlock()
	if t == nil || subtle.ConstantTimeCompare(t.token, a.GetToken()) != 1 {
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("attach.tunnel_id %q: no such tunnel waits on gateway %s (it timed out, or the token does not match)", a.GetTunnelId(), g.id))
	}
	body, _ := ctx.Value(bodyKey{}).(io.Closer)
	d := &daemonSide{stream: stream, attach: a, done: make(chan struct{}), breakRecv: func() {
		if body != nil {
			_ = body.Close()
		}
	}}
	select {
	case t.attached <- d:
	default:
		return connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("attach.tunnel_id %q is attached already", a.GetTunnelId()))
	}
	select {
	case <-d.done:
		return d.err
	case <-t.killed:
		// The relay finishes d as it ends; if it never took d (it gave up
		// while the daemon attached), nothing will.
		select {
		case <-d.done:
			return d.err
		case <-g.clock.After(tunnelEndWait):
			return t.killErr
		}
	}
}
