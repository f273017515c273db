// Package daemon is the node side of a session (docs/design.md#gateways): it
// dials a gateway through its balancer address over HTTP/2 (h2c or TLS),
// says Hello with the node's credential and the commands its journal has in
// flight, heartbeats, executes commands at most once through a Journal,
// and redials with full-jitter back-off, honouring Pushback and Drain.
//
// A silent gateway (a host gone without a RST, or a paused process) is
// detected by HTTP/2 PINGs after ReadIdleTimeout (10 s) with PingTimeout
// (5 s), or by a missing HeartbeatAck, whichever comes first: within 15 s.
package daemon

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"
	"github.com/jonboulle/clockwork"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/leasehold/leasehold/pkg/buildinfo"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1/nodev1connect"
	"github.com/leasehold/leasehold/pkg/nodeauth"
)

// Outcome is how a command ended, as the Handler reports it.
type Outcome struct {
	ExitCode int32
	Output   []byte
	// Err says why the command could not run or complete.
	Err string
}

// Handler executes a command. It runs on its own goroutine, at most once
// per command id over the journal's lifetime. ctx is cancelled when the
// control plane cancels the command (CancelCommand) or the daemon stops: a
// Handler must then return promptly. Output written to Stdout(ctx) and
// Stderr(ctx) is streamed to the control plane while the Handler runs.
type Handler func(ctx context.Context, cmd *nodev1.Command) Outcome

// Config configures a Daemon.
type Config struct {
	// Address is the gateway (balancer) base URL: http://host:port for h2c,
	// https://host:port for TLS.
	Address string
	// NodeID and Credential authenticate the node.
	NodeID, Credential string
	// CredentialFunc, when set, is asked for the credential at every Hello
	// and wins over Credential, so a credential rotated on disk is used
	// from the next session on without a restart. An error fails that
	// dial, which is retried with back-off.
	CredentialFunc func() (string, error)
	// Kind defaults to NODE_KIND_NODE.
	Kind nodev1.NodeKind
	// SiteID, Labels and Version are reported on Hello; an empty Version
	// reports the build's (pkg/buildinfo), which the gateway stores as the
	// node's daemon_version.
	SiteID  string
	Labels  map[string]string
	Version string
	// TLS is the client TLS configuration for https addresses (client
	// certificates for mTLS go here).
	TLS *tls.Config
	// Journal deduplicates replays (default: in memory).
	Journal Journal
	// Handler executes commands (required).
	Handler Handler
	// OnSpec receives the spec from Welcome and every NodeSpecUpdate.
	OnSpec func(*nodev1.NodeSpec)
	// OnWelcome is called for every accepted Hello.
	OnWelcome func(*nodev1.Welcome)

	// BackoffBase and BackoffMax bound redial back-off (1 s, 60 s);
	// StableAfter is how long a session must last to reset it (30 s).
	BackoffBase, BackoffMax, StableAfter time.Duration
	// HelloTimeout bounds the wait for Welcome (15 s).
	HelloTimeout time.Duration
	// HeartbeatTimeout is how long the daemon waits for any message,
	// heartbeat acks included, before it treats the gateway as silent
	// (default 2 heartbeat intervals + 2 s, at most 15 s).
	HeartbeatTimeout time.Duration
	// ReadIdleTimeout and PingTimeout tune HTTP/2 health pings (10 s, 5 s).
	ReadIdleTimeout, PingTimeout time.Duration
	// MaxMessageBytes bounds messages read from the gateway (4 MiB).
	MaxMessageBytes int
	// OutputFlush is the longest a written byte of live output waits
	// before it is sent (100 ms).
	OutputFlush time.Duration
	// MaxOutputBytes is how much live output of one command the daemon
	// sends at most (256 MiB); keep it above the gateway's
	// --gateway.output-cap, which is where the stored output ends: the
	// gateway relays the rest to live readers only.
	MaxOutputBytes int64
	// MaxUnsentOutput bounds the live output kept while no session is open
	// (1 MiB); past it pieces are dropped and counted in Stats.
	MaxUnsentOutput int

	// TunnelPorts are the loopback TCP ports an operator may open a tunnel
	// to (OpenTunnel); none by default: every port is refused
	// PERMISSION_DENIED.
	TunnelPorts []uint32
	// TunnelShell is the argv of the shell a shell tunnel runs, e.g.
	// ["/bin/sh"]; empty refuses shell tunnels. It runs on a pseudo-terminal
	// when the OpenTunnel carries a terminal size, with pipes otherwise, in a
	// session of its own that is killed when the tunnel or the shell ends.
	TunnelShell []string
	// TunnelShellUser is the user (name or numeric id) the shell runs as,
	// with that user's groups, home and a clean environment; empty runs it
	// as the daemon's own user with the daemon's environment. A user that
	// does not exist refuses the tunnel FAILED_PRECONDITION.
	TunnelShellUser string

	// Clock and Rand are injectable for tests.
	Clock clockwork.Clock
	Rand  func() float64
	// HTTPClient overrides the transport built from the fields above.
	HTTPClient connect.HTTPClient
	Logger     *slog.Logger
}

// Stats counts what a daemon did.
type Stats struct {
	Dials, Welcomes, Pushbacks, Drains, Executions, Replays int64
	// Cancels counts CancelCommand messages received; DroppedOutput the
	// bytes of live output dropped because no session was open for long.
	Cancels, DroppedOutput int64
	// TunnelsOpened and TunnelsRefused count tunnels attached and refused.
	TunnelsOpened, TunnelsRefused int64
}

// Daemon keeps a node's session.
type Daemon struct {
	cfg    Config
	client nodev1connect.NodeGatewayServiceClient
	// tunnels opens Tunnel streams on the same connections as client,
	// without gzip: tunnel bytes are relayed as they are.
	tunnels   nodev1connect.NodeGatewayServiceClient
	transport *http.Transport
	clock     clockwork.Clock
	log       *slog.Logger
	backoff   Backoff

	// failedDials counts the dials in a row that ended without a Welcome or
	// a pushback, and lastDialWarn is when one was last logged (Run only).
	failedDials  int
	lastDialWarn time.Time

	dials, welcomes, pushbacks, drains, executions, replays atomic.Int64
	cancels, droppedOutput                                  atomic.Int64
	tunnelsOpened, tunnelsRefused                           atomic.Int64

	mu      sync.Mutex
	running map[string]*execution
	// stopped are the commands whose handler returned after a cancel, so a
	// CancelCommand re-sent on a new session is answered "stopped" again.
	stopped     map[string]bool
	unsent      []*nodev1.ConnectRequest
	unsentBytes int
	stream      *connect.BidiStreamForClient[nodev1.ConnectRequest, nodev1.ConnectResponse]
	welcome     *nodev1.Welcome
	wg          sync.WaitGroup
}

// New validates cfg and returns a daemon; Run starts it.
func New(cfg Config) (*Daemon, error) {
	if cfg.Address == "" || cfg.NodeID == "" || (cfg.Credential == "" && cfg.CredentialFunc == nil) || cfg.Handler == nil {
		return nil, errors.New("daemon: Address, NodeID, Credential (or CredentialFunc) and Handler are required")
	}
	if !strings.HasPrefix(cfg.Address, "http://") && !strings.HasPrefix(cfg.Address, "https://") {
		return nil, fmt.Errorf("daemon: address %q must start with http:// (h2c) or https://", cfg.Address)
	}
	if err := checkClientCert(cfg); err != nil {
		return nil, err
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&cfg.BackoffBase, time.Second)
	def(&cfg.BackoffMax, 60*time.Second)
	def(&cfg.StableAfter, 30*time.Second)
	def(&cfg.HelloTimeout, 15*time.Second)
	def(&cfg.ReadIdleTimeout, 10*time.Second)
	def(&cfg.PingTimeout, 5*time.Second)
	if cfg.Kind == nodev1.NodeKind_NODE_KIND_UNSPECIFIED {
		cfg.Kind = nodev1.NodeKind_NODE_KIND_NODE
	}
	if cfg.Version == "" {
		cfg.Version = buildinfo.Version()
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = 4 << 20
	}
	def(&cfg.OutputFlush, 100*time.Millisecond)
	if cfg.MaxOutputBytes <= 0 {
		cfg.MaxOutputBytes = 256 << 20
	}
	if cfg.MaxUnsentOutput <= 0 {
		cfg.MaxUnsentOutput = 1 << 20
	}
	if cfg.Journal == nil {
		cfg.Journal = NewMemoryJournal()
	}
	if cfg.Clock == nil {
		cfg.Clock = clockwork.NewRealClock()
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	d := &Daemon{cfg: cfg, clock: cfg.Clock, log: cfg.Logger.With("node", cfg.NodeID), running: map[string]*execution{}, stopped: map[string]bool{},
		backoff: Backoff{Base: cfg.BackoffBase, Max: cfg.BackoffMax, Rand: cfg.Rand}}
	httpClient := cfg.HTTPClient
	if httpClient == nil {
		d.transport = newTransport(cfg)
		httpClient = &http.Client{Transport: d.transport}
	}
	d.client = nodev1connect.NewNodeGatewayServiceClient(httpClient, cfg.Address, connect.WithReadMaxBytes(cfg.MaxMessageBytes))
	d.tunnels = nodev1connect.NewNodeGatewayServiceClient(httpClient, cfg.Address, connect.WithReadMaxBytes(cfg.MaxMessageBytes),
		connect.WithAcceptCompression("gzip", nil, nil))
	return d, nil
}

// checkClientCert refuses a client certificate that explicitly names
// another node (a leasehold://node/<id> URI SAN): gateways binding mTLS
// certificates to node ids would refuse every Hello, and the node would
// redial forever. A certificate naming no node (a host certificate) passes:
// whether it is accepted is the gateway's --gateway.tls-bind-node-id.
func checkClientCert(cfg Config) error {
	if cfg.TLS == nil || len(cfg.TLS.Certificates) == 0 || len(cfg.TLS.Certificates[0].Certificate) == 0 {
		return nil
	}
	leaf := cfg.TLS.Certificates[0].Leaf
	if leaf == nil {
		var err error
		if leaf, err = x509.ParseCertificate(cfg.TLS.Certificates[0].Certificate[0]); err != nil {
			return fmt.Errorf("daemon: parse client certificate: %w", err)
		}
	}
	id, err := nodeauth.NodeIDFromCert(leaf)
	if err != nil {
		if errors.Is(err, nodeauth.ErrCertManyNodes) || errors.Is(err, nodeauth.ErrCertBadNodeURI) {
			return fmt.Errorf("daemon: client certificate: %w", err)
		}
		return nil
	}
	for _, u := range leaf.URIs {
		if strings.EqualFold(u.Scheme, nodeauth.URIScheme) && id != cfg.NodeID {
			return fmt.Errorf("daemon: client certificate names node %q, not NodeID %q", id, cfg.NodeID)
		}
	}
	return nil
}

func newTransport(cfg Config) *http.Transport {
	protocols := new(http.Protocols)
	if strings.HasPrefix(cfg.Address, "https://") {
		protocols.SetHTTP2(true)
	} else {
		protocols.SetUnencryptedHTTP2(true)
	}
	return &http.Transport{
		Protocols:       protocols,
		TLSClientConfig: cfg.TLS,
		DialContext:     (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		HTTP2: &http.HTTP2Config{
			SendPingTimeout: cfg.ReadIdleTimeout,
			PingTimeout:     cfg.PingTimeout,
		},
		TLSHandshakeTimeout: 10 * time.Second,
	}
}

// Stats returns the daemon's counters.
func (d *Daemon) Stats() Stats {
	return Stats{Dials: d.dials.Load(), Welcomes: d.welcomes.Load(), Pushbacks: d.pushbacks.Load(),
		Drains: d.drains.Load(), Executions: d.executions.Load(), Replays: d.replays.Load(),
		Cancels: d.cancels.Load(), DroppedOutput: d.droppedOutput.Load(),
		TunnelsOpened: d.tunnelsOpened.Load(), TunnelsRefused: d.tunnelsRefused.Load()}
}

// Welcome is the current session's Welcome, nil when not connected.
func (d *Daemon) Welcome() *nodev1.Welcome {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.stream == nil {
		return nil
	}
	return d.welcome
}

// ErrNotConnected is returned by SendEvent when no session is open.
var ErrNotConnected = errors.New("daemon: no session open")

// SendEvent sends an event on the current session. Events are facts
// deduplicated by event_id: resend with the same id after ErrNotConnected.
func (d *Daemon) SendEvent(ev *nodev1.Event) error {
	return d.send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Event{Event: ev}})
}

func (d *Daemon) send(msg *nodev1.ConnectRequest) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.stream == nil {
		return ErrNotConnected
	}
	return d.stream.Send(msg)
}

type sessionEnd struct {
	welcomed   bool
	lasted     time.Duration
	retryAfter time.Duration // from a Pushback
	pushback   bool
	drained    bool
	err        error
}

// Run keeps a session open until ctx ends, then waits for running commands.
func (d *Daemon) Run(ctx context.Context) error {
	defer d.wg.Wait()
	defer func() {
		if d.transport != nil {
			d.transport.CloseIdleConnections()
		}
	}()
	for ctx.Err() == nil {
		end := d.session(ctx)
		if ctx.Err() != nil {
			break
		}
		if connect.CodeOf(end.err) == connect.CodeInvalidArgument {
			// The gateway refused something this daemon sent for good. A
			// refused result has its command failed by the gateway, which
			// then no longer replays it, so the journalled result is not
			// sent again; the refusal is worth an operator's look.
			d.log.Warn("gateway refused a message for good", "err", end.err)
		}
		if d.transport != nil {
			// Redial on a fresh connection so the balancer picks again.
			d.transport.CloseIdleConnections()
		}
		var wait time.Duration
		switch {
		case end.pushback:
			// The gateway said when to come back: that replaces the
			// back-off, which restarts from its base, so a fleet refused
			// during an outage returns when told, not a minute later.
			d.pushbacks.Add(1)
			d.backoff.Reset()
			wait = end.retryAfter
		case end.drained:
			d.backoff.Reset()
		default:
			if end.welcomed && end.lasted >= d.cfg.StableAfter {
				d.backoff.Reset()
			}
			wait = d.backoff.Next()
		}
		d.log.Debug("session ended; redialling", "err", end.err, "wait", wait, "pushback", end.pushback, "drained", end.drained)
		d.warnFailedDial(end, wait)
		select {
		case <-ctx.Done():
		case <-d.clock.After(wait):
		}
	}
	return nil
}

var (
	errSilent  = errors.New("gateway silent: no message within the heartbeat timeout")
	errDrained = errors.New("gateway asked to drain")
)

func (d *Daemon) session(ctx context.Context) sessionEnd {
	d.dials.Add(1)
	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stream := d.client.Connect(sctx)
	// Go's HTTP/2 transport does not notice a cancelled context while it
	// waits for more of the request body, so closing the request side is
	// what ends the stream when the session is cancelled.
	closeReq := func() {
		d.mu.Lock()
		defer d.mu.Unlock()
		_ = stream.CloseRequest()
	}
	stopClose := context.AfterFunc(sctx, closeReq)
	defer func() {
		if stopClose() {
			closeReq()
		}
	}()
	cred := d.cfg.Credential
	if d.cfg.CredentialFunc != nil {
		c, err := d.cfg.CredentialFunc()
		if err != nil {
			return sessionEnd{err: fmt.Errorf("read the node credential: %w", err)}
		}
		cred = c
	}
	hello := &nodev1.Hello{
		NodeId: d.cfg.NodeID, Credential: cred, DaemonVersion: d.cfg.Version,
		InFlightCommandIds: d.cfg.Journal.InFlight(), Kind: d.cfg.Kind, SiteId: d.cfg.SiteID, Labels: d.cfg.Labels,
	}
	d.mu.Lock()
	err := stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Hello{Hello: hello}})
	d.mu.Unlock()
	if err != nil {
		_, rerr := stream.Receive() // the real error is on the receive side
		return sessionEnd{err: errors.Join(err, rerr)}
	}
	helloTimer := d.clock.AfterFunc(d.cfg.HelloTimeout, func() { cancel(errors.New("no Welcome within the hello timeout")) })
	first, err := stream.Receive()
	helloTimer.Stop()
	if err != nil {
		return sessionEnd{err: err}
	}
	if pb := first.GetPushback(); pb != nil {
		_, err := stream.Receive()
		return sessionEnd{pushback: true, retryAfter: pb.GetRetryAfter().AsDuration(), err: err}
	}
	welcome := first.GetWelcome()
	if welcome == nil {
		return sessionEnd{err: errors.New("gateway sent no Welcome")}
	}
	start := d.clock.Now()
	d.welcomes.Add(1)
	d.mu.Lock()
	d.stream, d.welcome = stream, welcome
	d.flushUnsentLocked() // output written while no session was open
	d.mu.Unlock()
	defer func() {
		d.mu.Lock()
		d.stream = nil
		d.mu.Unlock()
	}()
	if d.cfg.OnWelcome != nil {
		d.cfg.OnWelcome(welcome)
	}
	if d.cfg.OnSpec != nil && welcome.GetSpec() != nil {
		d.cfg.OnSpec(welcome.GetSpec())
	}

	interval := welcome.GetHeartbeatInterval().AsDuration()
	if interval <= 0 {
		interval = 5 * time.Second
	}
	timeout := d.cfg.HeartbeatTimeout
	if timeout <= 0 {
		timeout = min(2*interval+2*time.Second, 15*time.Second)
	}
	var lastRecv atomic.Int64
	lastRecv.Store(d.clock.Now().UnixNano())
	hbDone := make(chan struct{})
	go func() {
		defer close(hbDone)
		d.heartbeat(sctx, interval, timeout, &lastRecv, cancel)
	}()
	defer func() { cancel(nil); <-hbDone }()

	var drainTimer clockwork.Timer
	defer func() {
		if drainTimer != nil {
			drainTimer.Stop()
		}
	}()
	for {
		msg, err := stream.Receive()
		if err != nil {
			end := sessionEnd{welcomed: true, lasted: d.clock.Since(start), err: err}
			if cause := context.Cause(sctx); errors.Is(cause, errDrained) {
				end.drained = true
			} else if cause != nil && !errors.Is(cause, context.Canceled) {
				end.err = cause
			}
			return end
		}
		lastRecv.Store(d.clock.Now().UnixNano())
		switch m := msg.GetMsg().(type) {
		case *nodev1.ConnectResponse_Command:
			d.handleCommand(ctx, m.Command)
		case *nodev1.ConnectResponse_CancelCommand:
			d.handleCancel(m.CancelCommand)
		case *nodev1.ConnectResponse_OpenTunnel:
			// On the session's context: a tunnel ends with its session.
			d.wg.Add(1)
			go d.openTunnel(sctx, m.OpenTunnel)
		case *nodev1.ConnectResponse_NodeSpecUpdate:
			if d.cfg.OnSpec != nil && m.NodeSpecUpdate.GetSpec() != nil {
				d.cfg.OnSpec(m.NodeSpecUpdate.GetSpec())
			}
		case *nodev1.ConnectResponse_Drain:
			if drainTimer == nil {
				delay := m.Drain.GetDelay().AsDuration()
				d.log.Info("gateway asked to drain", "delay", delay, "reason", m.Drain.GetReason())
				// Keep serving on this stream for the delay, then redial.
				drainTimer = d.clock.AfterFunc(delay, func() { cancel(errDrained) })
				d.drains.Add(1)
			}
		case *nodev1.ConnectResponse_HeartbeatAck, *nodev1.ConnectResponse_Welcome, *nodev1.ConnectResponse_Pushback:
		}
	}
}

func (d *Daemon) heartbeat(ctx context.Context, interval, timeout time.Duration, lastRecv *atomic.Int64, cancel context.CancelCauseFunc) {
	t := d.clock.NewTicker(min(interval, timeout/2))
	defer t.Stop()
	var seq uint64
	nextBeat := d.clock.Now()
	for {
		now := d.clock.Now()
		if now.Sub(time.Unix(0, lastRecv.Load())) > timeout {
			d.log.Warn("gateway silent; redialling", "timeout", timeout)
			cancel(errSilent)
			return
		}
		if !now.Before(nextBeat) {
			seq++
			_ = d.send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Heartbeat{Heartbeat: &nodev1.Heartbeat{
				SentAt: timestamppb.New(now), Sequence: seq,
			}}})
			nextBeat = now.Add(interval)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.Chan():
		}
	}
}

// handleCommand runs a command at most once: a command with a journalled
// result has its result re-sent; one started but never finished (the daemon
// died meanwhile) is reported interrupted; one running now is left alone.
func (d *Daemon) handleCommand(ctx context.Context, cmd *nodev1.Command) {
	id := cmd.GetCommandId()
	if id == "" {
		return
	}
	d.mu.Lock()
	if d.running[id] != nil {
		d.mu.Unlock()
		d.replays.Add(1)
		return
	}
	result, executed := d.cfg.Journal.Seen(id)
	switch {
	case result != nil:
		d.mu.Unlock()
		d.replays.Add(1)
		d.sendResult(result)
		return
	case executed:
		d.mu.Unlock()
		d.replays.Add(1)
		d.finish(id, &nodev1.CommandResult{CommandId: id, ResultId: id + "/interrupted", ExitCode: -1,
			Error: "the daemon stopped while this command ran; it is not run again", FinishedAt: timestamppb.New(d.clock.Now())})
		return
	case cmd.GetDeadline() != nil && d.clock.Now().After(cmd.GetDeadline().AsTime()):
		d.mu.Unlock()
		d.finish(id, &nodev1.CommandResult{CommandId: id, ResultId: id + "/deadline", ExitCode: -1,
			Error: "deadline passed before the command started", FinishedAt: timestamppb.New(d.clock.Now())})
		return
	}
	if err := d.cfg.Journal.Record(id, nil); err != nil {
		d.mu.Unlock()
		d.log.Error("journal command start; not executing", "command", id, "err", err)
		return
	}
	cctx, cancel := context.WithCancel(ctx)
	out := &output{id: id, send: d.sendOutput, clock: d.clock, every: d.cfg.OutputFlush, limit: d.cfg.MaxOutputBytes}
	ex := &execution{cancel: cancel}
	d.running[id] = ex
	d.mu.Unlock()
	_ = d.send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandAck{CommandAck: &nodev1.CommandAck{CommandId: id}}})
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		defer cancel()
		started := d.clock.Now()
		d.executions.Add(1)
		o := d.cfg.Handler(context.WithValue(cctx, outputKey{}, out), cmd)
		out.close() // every piece goes before the result
		d.mu.Lock()
		cancelled := ex.cancelRequested
		d.mu.Unlock()
		if cancelled && o.Err == "" {
			o.Err = "cancelled by CancelCommand"
		}
		res := &nodev1.CommandResult{CommandId: id, ResultId: id + "/1", ExitCode: o.ExitCode, Output: o.Output,
			Error: o.Err, StartedAt: timestamppb.New(started), FinishedAt: timestamppb.New(d.clock.Now())}
		d.finish(id, res)
		d.mu.Lock()
		delete(d.running, id)
		cancelled = ex.cancelRequested // a cancel may have come while the result was journalled
		if cancelled {
			if len(d.stopped) >= maxStopped {
				clear(d.stopped) // bounded: a forgotten one is answered ALREADY_FINISHED
			}
			d.stopped[id] = true
		}
		d.mu.Unlock()
		if cancelled {
			d.sendCancelAck(id, nodev1.CancelOutcome_CANCEL_OUTCOME_STOPPED)
		}
	}()
}

// finish journals res, then sends it. Error is made valid UTF-8 without
// NUL first: protojson (the journal) and protobuf (the stream) refuse
// invalid UTF-8 in a string field, and PostgreSQL's text refuses NUL, so a
// Handler's raw error bytes would otherwise leave the result unjournalled,
// unsendable or unstorable, and the command replayed forever. Output is a
// bytes field (base64 in the journal, bytea in the database): any bytes go.
func (d *Daemon) finish(id string, res *nodev1.CommandResult) {
	res.Error = sanitizeText(res.GetError())
	if err := d.cfg.Journal.Record(id, res); err != nil {
		d.log.Error("journal command result", "command", id, "err", err)
	}
	d.sendResult(res)
}

// sendResult sends res now if a session is open; otherwise the gateway
// replays the command on the next Hello and the journal re-sends it.
func (d *Daemon) sendResult(res *nodev1.CommandResult) {
	if err := d.send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_CommandResult{CommandResult: res}}); err != nil {
		d.log.Debug("result not sent now; it is re-sent on replay", "command", res.GetCommandId(), "err", err)
	}
}

// sanitizeText replaces invalid UTF-8 and NUL bytes with U+FFFD.
func sanitizeText(s string) string {
	if utf8.ValidString(s) && !strings.ContainsRune(s, 0) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

func discardLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

// dialWarnEvery bounds how often a daemon that cannot open a session says
// so: the first failure, then once a minute while they go on.
const dialWarnEvery = time.Minute

// warnFailedDial logs a dial that ended without a session (refused
// connection, TLS handshake, DNS, a gateway answering an error) at Warn,
// the first of a run of them and then once every dialWarnEvery, so an
// agent that cannot reach its gateways says why without flooding its log.
func (d *Daemon) warnFailedDial(end sessionEnd, wait time.Duration) {
	if end.welcomed || end.pushback || end.drained || end.err == nil {
		d.failedDials = 0
		return
	}
	d.failedDials++
	now := d.clock.Now()
	if d.failedDials > 1 && now.Sub(d.lastDialWarn) < dialWarnEvery {
		return
	}
	d.lastDialWarn = now
	d.log.Warn("cannot open a session with the gateway; redialling", "address", d.cfg.Address, "failed_dials", d.failedDials, "retry_in", wait, "err", end.err)
}
