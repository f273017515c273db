package api

// OpenTunnel (docs/api.md, "Tunnels"): the api validates the first message,
// finds the gateway that holds the node's session (node_sessions joined with
// a live gateway:<id> lease and the relay address the gateway published in
// gateway_relays), opens RelayTunnel there with the shared relay token and
// relays the caller's bytes to it and back, one message at a time each way,
// so HTTP/2 flow control is the only buffer. Every open (refused or not) and
// every close is an audit_events row. A shell may ask for a pseudo-terminal
// (terminal_size, term); its resizes go to the node and how it ended
// (shell_exit) comes back before the node's eof.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/coord"
	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	relayv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/relay/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/relay/v1/relayv1connect"
	"github.com/leasehold/leasehold/pkg/relaytoken"
	"github.com/leasehold/leasehold/pkg/reload"
)

// maxTunnelChunk is the most bytes a caller may send in one tunnel message.
const maxTunnelChunk = 64 << 10

// tunnelEndWait bounds how long a finished tunnel waits for its copy
// goroutine once the caller's stream was broken.
const tunnelEndWait = 5 * time.Second

type tunnelBodyKey struct{}

// relayDialer reaches gateways' relay listeners: over TLS with the api's
// client certificate when --api.relay-tls.* files are given (else h2c),
// with the shared token when --api.relay-token-file is given.
type relayDialer struct {
	client     *http.Client
	scheme     string            // "https" or "http"
	token      *relaytoken.Token // nil: no token
	tls        *reload.ClientTLS // nil: h2c
	serverName string
}

// newRelayDialer loads the relay's token and TLS files; nil without
// either (tunnels are then refused FAILED_PRECONDITION).
func newRelayDialer(cfg Config, opts reload.Options) (*relayDialer, error) {
	if cfg.RelayTokenFile == "" && cfg.RelayTLS.Empty() {
		return nil, nil
	}
	d := &relayDialer{scheme: "http", serverName: cfg.RelayServerName}
	if cfg.RelayTokenFile != "" {
		t, err := relaytoken.Watch("api-relay-token", "--api.relay-token-file", cfg.RelayTokenFile, opts)
		if err != nil {
			return nil, err
		}
		d.token = t
	}
	protocols := new(http.Protocols)
	tr := &http.Transport{
		DialContext: (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		// A gateway host that vanishes without a RST is noticed by pings.
		HTTP2: &http.HTTP2Config{SendPingTimeout: 10 * time.Second, PingTimeout: 5 * time.Second},
	}
	if cfg.RelayTLS.Empty() {
		protocols.SetUnencryptedHTTP2(true)
	} else {
		t, err := reload.NewClientTLS("api-relay", cfg.RelayTLS, opts)
		if err != nil {
			return nil, fmt.Errorf("load --api.relay-tls.ca-file %q / --api.relay-tls.cert-file %q / --api.relay-tls.key-file %q: %w",
				cfg.RelayTLS.CA, cfg.RelayTLS.Cert, cfg.RelayTLS.Key, err)
		}
		d.tls, d.scheme = t, "https"
		protocols.SetHTTP2(true)
		tc := t.Config()
		tc.NextProtos = []string{"h2"}
		tc.ServerName = cfg.RelayServerName
		tr.TLSClientConfig = tc
	}
	tr.Protocols = protocols
	d.client = &http.Client{Transport: tr}
	return d, nil
}

// watchers are the dialer's files to re-read.
func (d *relayDialer) watchers() []*reload.Watcher {
	var ws []*reload.Watcher
	if d != nil && d.token != nil {
		ws = append(ws, d.token.Watcher)
	}
	if d != nil && d.tls != nil && d.tls.Watcher != nil {
		ws = append(ws, d.tls.Watcher)
	}
	return ws
}

// tunnelRouteSQL finds a node and, when it has a live session on a gateway
// whose lease is live, that gateway and its relay address.
var tunnelRouteSQL = `
SELECT n.state = 'revoked', coalesce(s.gateway_id, ''), coalesce(r.relay_addr, '')
  FROM nodes n
  LEFT JOIN node_sessions s ON s.node_id = n.id AND s.state = 'connected' AND s.session_expires_at > compute_now()
       AND ` + coord.GatewayLeaseLive("s.gateway_id") + `
  LEFT JOIN gateway_relays r ON r.gateway_id = s.gateway_id
 WHERE n.id = $1`

// validateTunnelOpen checks OpenTunnel's first message, naming the field.
func validateTunnelOpen(m *controlv1.OpenTunnelRequest) (target string, err error) {
	o := m.GetOpen()
	if o == nil {
		return "", invalid("open", "the first message must set open (node_id and target)")
	}
	if len(m.GetData()) > 0 {
		return "", invalid("data", "the first message carries no data")
	}
	if err := checkRE("open.node_id", o.GetNodeId(), idRE); err != nil {
		return "", err
	}
	switch k := o.GetTarget().GetKind().(type) {
	case *controlv1.TunnelTarget_Port:
		if k.Port < 1 || k.Port > 65535 {
			return "", invalid("open.target.port", "%d is not a TCP port (1..65535)", k.Port)
		}
		target = fmt.Sprintf("port:%d", k.Port)
	case *controlv1.TunnelTarget_Shell:
		if !k.Shell {
			return "", invalid("open.target.shell", "must be true when set")
		}
		target = "shell"
	default:
		return "", invalid("open.target", "must set port or shell")
	}
	if sz := o.GetTerminalSize(); sz != nil {
		if target != "shell" {
			return "", invalid("open.terminal_size", "only a shell target runs on a terminal")
		}
		if err := checkTerminalSize("open.terminal_size", sz); err != nil {
			return "", err
		}
	}
	if t := o.GetTerm(); t != "" {
		if o.GetTerminalSize() == nil {
			return "", invalid("open.term", "set only with open.terminal_size (a shell on a terminal)")
		}
		if !termRE.MatchString(t) {
			return "", invalid("open.term", "must be 1..64 bytes of [A-Za-z0-9._+-]")
		}
	}
	return target, nil
}

// maxTerminalCells bounds a terminal's rows and cols.
const maxTerminalCells = 10000

// termRE is a TERM value: a plain terminal name.
var termRE = regexp.MustCompile(`^[A-Za-z0-9._+-]{1,64}$`)

// checkTerminalSize refuses a size whose rows or cols are outside
// 1..maxTerminalCells, naming field.
func checkTerminalSize(field string, sz *nodev1.TerminalSize) error {
	if sz.GetRows() < 1 || sz.GetRows() > maxTerminalCells || sz.GetCols() < 1 || sz.GetCols() > maxTerminalCells {
		return invalid(field, "%dx%d: rows and cols must be in 1..%d", sz.GetRows(), sz.GetCols(), maxTerminalCells)
	}
	return nil
}

// OpenTunnel relays a tunnel to a node through the gateway that holds its session.
func (h *Handler) OpenTunnel(ctx context.Context, stream *connect.BidiStream[controlv1.OpenTunnelRequest, controlv1.OpenTunnelResponse]) error {
	first, err := stream.Receive()
	if err != nil {
		if errors.Is(err, io.EOF) {
			return invalid("open", "the stream ended before its first message")
		}
		return err
	}
	target, err := validateTunnelOpen(first)
	if err != nil {
		return err
	}
	nodeID := first.GetOpen().GetNodeId()
	ev := auditEvent{Method: "tunnel.open", TargetKind: "node", TargetID: nodeID, Detail: map[string]any{"target": target}}
	refuse := func(cerr error) error {
		ev.Outcome = connect.CodeOf(cerr).String()
		ev.Detail["error"] = abbrev(cerr.Error())
		if err := h.recordAudit(ctx, h.db, ev); err != nil {
			return h.fail(ctx, "open tunnel", err)
		}
		return cerr
	}
	if h.relay == nil {
		return refuse(connect.NewError(connect.CodeFailedPrecondition, errors.New("tunnels are not enabled on this api (--api.relay-token-file or --api.relay-tls.*)")))
	}
	var (
		revoked       bool
		gateway, addr string
	)
	err = h.db.QueryRow(ctx, tunnelRouteSQL, nodeID).Scan(&revoked, &gateway, &addr)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return notFound("open.node_id", "node", nodeID)
	case err != nil:
		return h.fail(ctx, "open tunnel", err)
	case revoked:
		return refuse(connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("open.node_id: node %q is revoked", nodeID)))
	case gateway == "":
		return refuse(connect.NewError(connect.CodeUnavailable, fmt.Errorf("open.node_id: node %q has no live session on any gateway; retry once it is connected", nodeID)))
	case addr == "":
		return refuse(connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("gateway %s, which holds node %q's session, relays no tunnels (--gateway.relay-listen-addr)", gateway, nodeID)))
	}
	ev.Detail["gateway"] = gateway

	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	client := relayv1connect.NewGatewayRelayServiceClient(h.relay.client, h.relay.scheme+"://"+addr,
		connect.WithReadMaxBytes(2*maxTunnelChunk), connect.WithSendMaxBytes(2*maxTunnelChunk),
		connect.WithAcceptCompression("gzip", nil, nil)) // bytes as they are: no gzip per message
	rs := client.RelayTunnel(rctx)
	if h.relay.token != nil {
		rs.RequestHeader().Set("Authorization", "Bearer "+h.relay.token.Value())
	}
	actor := "unauthenticated"
	if id, ok := IdentityFrom(ctx); ok {
		actor = id.ID
	}
	if err := rs.Send(&relayv1.RelayTunnelRequest{Open: &relayv1.RelayOpen{NodeId: nodeID, Target: first.GetOpen().GetTarget(), Actor: actor,
		TerminalSize: first.GetOpen().GetTerminalSize(), Term: first.GetOpen().GetTerm()}}); err != nil && !errors.Is(err, io.EOF) {
		return refuse(gatewayGone(gateway, "", err))
	}
	opened, err := rs.Receive()
	if err != nil {
		_ = rs.CloseRequest()
		return refuse(gatewayGone(gateway, "", err))
	}
	tunnelID := opened.GetOpened().GetTunnelId()
	if tunnelID == "" {
		_ = rs.CloseRequest()
		return refuse(connect.NewError(connect.CodeInternal, fmt.Errorf("gateway %s answered without opening the tunnel", gateway)))
	}
	ev.Detail["tunnel_id"] = tunnelID
	if err := h.recordAudit(ctx, h.db, ev); err != nil {
		_ = rs.CloseRequest()
		return h.fail(ctx, "open tunnel", err)
	}
	if err := stream.Send(&controlv1.OpenTunnelResponse{Opened: opened.GetOpened()}); err != nil {
		_ = rs.CloseRequest()
		h.auditTunnelClose(ctx, nodeID, tunnelID, gateway, 0, 0, nil, err)
		return err
	}

	var toNode, fromNode atomic.Int64
	pty := first.GetOpen().GetTerminalSize() != nil
	up := make(chan error, 1)
	var callerEnded atomic.Bool // the caller's side ended the tunnel
	// caller -> gateway
	go func() {
		// endTunnel ends the tunnel from the caller's side (a bad message, or
		// the caller gone) while the node may be silent: the relay is
		// cancelled and its request side closed (Go's HTTP/2 client does
		// not notice the cancel while it waits for more of the request
		// body), which ends the loop below; err is the tunnel's error.
		endTunnel := func(err error) {
			callerEnded.Store(true)
			up <- err
			cancel()
			_ = rs.CloseRequest()
		}
		for {
			m, err := stream.Receive()
			if errors.Is(err, io.EOF) {
				up <- rs.CloseRequest()
				return
			}
			if err != nil {
				endTunnel(connect.NewError(connect.CodeCanceled, fmt.Errorf("the caller's side ended: %w", err)))
				return
			}
			if m.GetOpen() != nil {
				endTunnel(invalid("open", "only the first message may set open"))
				return
			}
			if len(m.GetData()) > maxTunnelChunk {
				endTunnel(invalid("data", "%d bytes, more than %d per message", len(m.GetData()), maxTunnelChunk))
				return
			}
			if rz := m.GetResize(); rz != nil {
				if !pty {
					endTunnel(invalid("resize", "the tunnel has no terminal (its open set no terminal_size)"))
					return
				}
				if err := checkTerminalSize("resize", rz); err != nil {
					endTunnel(err)
					return
				}
			}
			if len(m.GetData()) == 0 && m.GetResize() == nil {
				continue
			}
			if err := rs.Send(&relayv1.RelayTunnelRequest{Data: m.GetData(), Resize: m.GetResize()}); err != nil {
				// The real error is on the receive side, which ends the tunnel.
				up <- nil
				return
			}
			toNode.Add(int64(len(m.GetData())))
		}
	}()
	// gateway -> caller, until the gateway ends the tunnel.
	var (
		failure   error
		shellExit *nodev1.ShellExit
	)
	for failure == nil {
		m, err := rs.Receive()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			failure = gatewayGone(gateway, tunnelID, err)
			break
		}
		if m.GetShellExit() != nil {
			shellExit = m.GetShellExit()
		}
		if len(m.GetData()) > 0 || m.GetEof() || m.GetShellExit() != nil {
			if err := stream.Send(&controlv1.OpenTunnelResponse{Data: m.GetData(), Eof: m.GetEof(), ShellExit: m.GetShellExit()}); err != nil {
				failure = connect.NewError(connect.CodeCanceled, fmt.Errorf("the caller's side failed: %w", err))
				break
			}
			fromNode.Add(int64(len(m.GetData())))
		}
	}
	select {
	case err := <-up:
		// When the caller's side ended the tunnel (a bad message, or the
		// caller gone), that is why the relay ended, whatever its Receive
		// said.
		if failure == nil || callerEnded.Load() {
			failure = err
		}
	default:
		// The caller is still sending (or silent): break its Receive.
		if body, ok := ctx.Value(tunnelBodyKey{}).(io.Closer); ok {
			_ = body.Close()
		}
		cancel()
		select {
		case <-up:
		case <-time.After(tunnelEndWait):
		}
	}
	h.auditTunnelClose(ctx, nodeID, tunnelID, gateway, toNode.Load(), fromNode.Load(), shellExit, failure)
	return failure
}

// gatewayGone words a relay error for the caller: the gateway's own errors
// keep their code; a lost connection is UNAVAILABLE.
func gatewayGone(gateway, tunnelID string, err error) error {
	var ce *connect.Error
	code := connect.CodeUnavailable
	msg := err.Error()
	if errors.As(err, &ce) {
		msg = ce.Message()
		switch ce.Code() {
		case connect.CodeUnknown, connect.CodeInternal, connect.CodeCanceled, connect.CodeUnavailable:
		default:
			code = ce.Code()
		}
	}
	if tunnelID == "" {
		return connect.NewError(code, fmt.Errorf("gateway %s: %s", gateway, msg))
	}
	if code == connect.CodeUnavailable {
		return connect.NewError(code, fmt.Errorf("tunnel %s ended: its gateway %s or the node's session went away (%s); open a new tunnel", tunnelID, gateway, msg))
	}
	return connect.NewError(code, fmt.Errorf("tunnel %s ended: %s", tunnelID, msg))
}

// auditTunnelClose records a tunnel's end, with how its shell ended when
// the node said; it is written even when the caller has gone (its context
// is done).
func (h *Handler) auditTunnelClose(ctx context.Context, nodeID, tunnelID, gateway string, toNode, fromNode int64, shellExit *nodev1.ShellExit, failure error) {
	ev := auditEvent{Method: "tunnel.close", TargetKind: "node", TargetID: nodeID, Outcome: "ok",
		Detail: map[string]any{"tunnel_id": tunnelID, "gateway": gateway, "bytes_to_node": toNode, "bytes_from_node": fromNode}}
	if shellExit != nil {
		ev.Detail["shell_exit_code"] = shellExit.GetExitCode()
		if sig := shellExit.GetSignal(); sig != "" {
			ev.Detail["shell_signal"] = abbrev(sig)
		}
	}
	if failure != nil {
		ev.Outcome = connect.CodeOf(failure).String()
		ev.Detail["error"] = abbrev(failure.Error())
	}
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := h.recordAudit(actx, h.db, ev); err != nil {
		h.log.ErrorContext(ctx, "audit tunnel close", "tunnel", tunnelID, "err", err)
	}
}
