package gateway

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"golang.org/x/sync/semaphore"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

type pgxTx = pgx.Tx

var (
	errSlowNode      = errors.New("node does not read its stream: too many queued messages")
	errFirstNotHello = errors.New("the first message of a stream must be a Hello")
	errSecondHello   = errors.New("a stream carries exactly one Hello; this one already said Hello")
	errBadCredential = errors.New("node credential not accepted")
)

// Limits on what a node may send, beside the message size limit.
const (
	maxIDLen        = 200
	maxInFlightIDs  = 10000
	maxLabels       = 64
	maxLabelLen     = 256
	maxVersionLen   = 100
	maxKindLen      = 100
	maxCredentialSz = nodeauth.MaxCredentialLen
)

// helloWorkTimeout bounds the Hello's credential check and transaction.
const helloWorkTimeout = 15 * time.Second

// readableBody is a request body that says when Read would not block
// (h2serve's).
type readableBody interface {
	WaitReadable() <-chan struct{}
}

// receiveHello waits at most HelloTimeout for the stream's first message.
// On a timeout the handler returns, which ends the stream and with it the
// blocked Receive.
func (g *Gateway) receiveHello(ctx context.Context, stream *connect.BidiStream[nodev1.ConnectRequest, nodev1.ConnectResponse]) (*nodev1.ConnectRequest, error) {
	if body, ok := ctx.Value(bodyKey{}).(readableBody); ok {
		// The lean server's body can be closed from outside: Receive here
		// and let the timer close the body, which breaks the Receive, so
		// a Hello that never comes and one that stalls half-way are both
		// bounded without a goroutine.
		var timedOut atomic.Bool
		t := g.clock.AfterFunc(g.cfg.HelloTimeout, func() {
			timedOut.Store(true)
			if c, ok := body.(io.Closer); ok {
				_ = c.Close()
			}
		})
		m, err := stream.Receive() // waits in the body's Read, no goroutine
		if !t.Stop() && timedOut.Load() {
			return nil, connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("no Hello within %s", g.cfg.HelloTimeout))
		}
		if err != nil {
			return nil, receiveError(err)
		}
		return m, nil
	}
	type received struct {
		msg *nodev1.ConnectRequest
		err error
	}
	ch := make(chan received, 1)
	go func() {
		m, err := stream.Receive()
		ch <- received{m, err}
	}()
	t := g.clock.NewTimer(g.cfg.HelloTimeout)
	defer t.Stop()
	select {
	case r := <-ch:
		if r.err != nil {
			return nil, receiveError(r.err)
		}
		return r.msg, nil
	case <-t.Chan():
		return nil, connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("no Hello within %s", g.cfg.HelloTimeout))
	}
}

// Connect serves one node stream (nodev1connect.NodeGatewayServiceHandler).
func (g *Gateway) Connect(ctx context.Context, stream *connect.BidiStream[nodev1.ConnectRequest, nodev1.ConnectResponse]) error {
	n := g.streams.Add(1)
	g.m.streams.Set(float64(n))
	defer func() { g.m.streams.Set(float64(g.streams.Add(-1))) }()

	switch g.state.Load() {
	case stateServing:
	case stateDraining:
		return g.pushback(stream, "draining", time.Second+rand.N(4*time.Second), connect.CodeUnavailable)
	default:
		// Starting, or fenced while the database is away: it serves again
		// as soon as it holds its lease, so the node is told to come back
		// in a second or three rather than left to its back-off, which an
		// outage would otherwise grow towards a minute. The pushback costs
		// no database work; the jitter and the admission bucket spread the
		// fleet's return.
		return g.pushback(stream, "not-serving", notServingRetryAfter(), connect.CodeUnavailable)
	}
	if n > int64(g.cfg.MaxStreams) {
		return g.pushback(stream, "max-streams", 5*time.Second+rand.N(5*time.Second), connect.CodeResourceExhausted)
	}

	first, err := g.receiveHello(ctx, stream)
	if err != nil {
		g.m.hellos.WithLabelValues("refused").Inc()
		return err
	}
	hello := first.GetHello()
	if hello == nil {
		g.m.hellos.WithLabelValues("refused").Inc()
		return connect.NewError(connect.CodeInvalidArgument, errFirstNotHello)
	}
	if err := validateHello(hello); err != nil {
		g.m.hellos.WithLabelValues("refused").Inc()
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	// Before the admission token, the credential and any database access.
	if g.bindsNodeID() {
		cs, _ := ctx.Value(tlsStateKey{}).(*tls.ConnectionState)
		if err := certNodeError(cs, hello.GetNodeId()); err != nil {
			g.m.hellos.WithLabelValues("refused").Inc()
			g.log.Warn("hello refused: node id not bound to the client certificate", "peer", stream.Peer().Addr, "err", err)
			return err
		}
	}
	// Before the admission token too: the check is free, and an old
	// fleet's dials should not use up the Hello rate of current daemons.
	if why := versionRefusal(hello.GetDaemonVersion(), g.minDaemonVersion); why != "" {
		g.log.Info("hello refused: daemon version", "node", hello.GetNodeId(), "daemon_version", hello.GetDaemonVersion(), "min", g.minDaemonVersion)
		return g.refuse(stream, "daemon-version", versionRetryAfter(), connect.CodeFailedPrecondition, why)
	}
	if !g.limiter.AllowN(g.clock.Now(), 1) {
		return g.pushback(stream, "hello-rate", g.rateRetryAfter(), connect.CodeResourceExhausted)
	}
	if g.pending.Add(1) > int64(g.cfg.MaxPendingHellos) {
		g.pending.Add(-1)
		return g.pushback(stream, "max-pending-hellos", 500*time.Millisecond+rand.N(500*time.Millisecond), connect.CodeResourceExhausted)
	}
	// The Hello's database work runs detached from the stream, bounded, so
	// a client vanishing mid-Hello cannot abort it half-way.
	helloCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), helloWorkTimeout)
	gen := g.generation.Load()
	s, welcome, replays, err := g.hello(helloCtx, stream, hello)
	cancel()
	g.pending.Add(-1)
	if err != nil {
		return err
	}
	s.generation = gen
	return g.serveSession(ctx, stream, s, welcome, replays)
}

// receiveError keeps a Connect error's code (e.g. RESOURCE_EXHAUSTED for an
// oversized message) and maps a clean end of stream to CANCELED.
func receiveError(err error) error {
	if errors.Is(err, io.EOF) {
		return connect.NewError(connect.CodeCanceled, errors.New("stream ended before Hello"))
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce
	}
	return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("read message: %w", err))
}

// notServingRetryAfter is the retry delay a starting or fenced gateway
// gives: 1 to 3 s, so a fleet is back within seconds of the gateway
// serving again, spread over two seconds.
func notServingRetryAfter() time.Duration { return time.Second + rand.N(2*time.Second) }

// pushback refuses a dial: it sends Pushback{retry_after} and closes the
// stream with code.
func (g *Gateway) pushback(stream *connect.BidiStream[nodev1.ConnectRequest, nodev1.ConnectResponse], reason string, retryAfter time.Duration, code connect.Code) error {
	return g.refuse(stream, reason, retryAfter, code, "admission refused ("+reason+")")
}

// refuse sends Pushback{retry_after, reason} and closes the stream with
// code and msg, which the retry-after is appended to.
func (g *Gateway) refuse(stream *connect.BidiStream[nodev1.ConnectRequest, nodev1.ConnectResponse], reason string, retryAfter time.Duration, code connect.Code, msg string) error {
	g.m.hellos.WithLabelValues("pushback").Inc()
	g.m.pushbacks.WithLabelValues(reason).Inc()
	_ = stream.Send(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Pushback{Pushback: &nodev1.Pushback{
		RetryAfter: durationpb.New(retryAfter), Reason: reason,
	}}})
	return connect.NewError(code, fmt.Errorf("%s: retry after %s", msg, retryAfter.Round(time.Millisecond)))
}

// rateRetryAfter hands each dial refused by the token bucket its own slot
// in a virtual queue drained at the bucket's rate, so a herd comes back
// spread over the time the bucket needs to admit it.
func (g *Gateway) rateRetryAfter() time.Duration {
	now := g.clock.Now()
	g.slotMu.Lock()
	defer g.slotMu.Unlock()
	if g.nextSlot.Before(now) {
		g.nextSlot = now
	}
	g.nextSlot = g.nextSlot.Add(time.Duration(float64(time.Second) / g.cfg.HelloRate))
	return min(g.nextSlot.Sub(now), time.Minute)
}

// bindsNodeID reports whether a Hello's node_id must be the node its
// verified client certificate names (mTLS with --gateway.tls-bind-node-id).
func (g *Gateway) bindsNodeID() bool { return g.cfg.TLSClientCA != "" && g.cfg.TLSBindNodeID }

// certNodeError refuses, PERMISSION_DENIED, a Hello as nodeID on a
// connection whose verified client certificate does not name nodeID
// (nodeauth.NodeIDFromCert). A connection without a verified chain is
// refused too: the binding fails closed.
func certNodeError(cs *tls.ConnectionState, nodeID string) error {
	if cs == nil || len(cs.VerifiedChains) == 0 || len(cs.VerifiedChains[0]) == 0 {
		return connect.NewError(connect.CodePermissionDenied,
			fmt.Errorf("hello.node_id %q: the connection has no verified client certificate to bind it to", nodeID))
	}
	named, err := nodeauth.NodeIDFromCert(cs.VerifiedChains[0][0])
	if err != nil {
		return connect.NewError(connect.CodePermissionDenied, fmt.Errorf("hello.node_id %q: %w", nodeID, err))
	}
	if named != nodeID {
		return connect.NewError(connect.CodePermissionDenied,
			fmt.Errorf("hello.node_id %q is not the node named by the client certificate (%q)", nodeID, named))
	}
	return nil
}

func validateHello(h *nodev1.Hello) error {
	if err := nodeauth.ValidateNodeID(h.GetNodeId()); err != nil {
		return fmt.Errorf("hello.node_id: %w", err)
	}
	if len(h.GetCredential()) == 0 || len(h.GetCredential()) > maxCredentialSz {
		return fmt.Errorf("hello.credential must be 1..%d bytes", maxCredentialSz)
	}
	if len(h.GetDaemonVersion()) > maxVersionLen {
		return fmt.Errorf("hello.daemon_version longer than %d bytes", maxVersionLen)
	}
	if k := h.GetKind(); k != nodev1.NodeKind_NODE_KIND_NODE && k != nodev1.NodeKind_NODE_KIND_SITE_AGENT {
		return fmt.Errorf("hello.kind %d must be NODE_KIND_NODE or NODE_KIND_SITE_AGENT", k)
	}
	if len(h.GetInFlightCommandIds()) > maxInFlightIDs {
		return fmt.Errorf("hello.in_flight_command_ids has %d ids, more than %d", len(h.GetInFlightCommandIds()), maxInFlightIDs)
	}
	for _, id := range h.GetInFlightCommandIds() {
		if len(id) == 0 || len(id) > maxIDLen {
			return fmt.Errorf("hello.in_flight_command_ids: ids must be 1..%d bytes", maxIDLen)
		}
	}
	if len(h.GetLabels()) > maxLabels {
		return fmt.Errorf("hello.labels has %d labels, more than %d", len(h.GetLabels()), maxLabels)
	}
	for k, v := range h.GetLabels() {
		if len(k) == 0 || len(k) > maxLabelLen || len(v) > maxLabelLen {
			return fmt.Errorf("hello.labels: keys must be 1..%d bytes and values at most %d", maxLabelLen, maxLabelLen)
		}
		// PostgreSQL's jsonb refuses NUL: refused here, the node is told
		// its Hello is wrong (INVALID_ARGUMENT) instead of retrying a
		// write that can never succeed.
		if strings.ContainsRune(k, 0) || strings.ContainsRune(v, 0) {
			return fmt.Errorf("hello.labels: key %q holds a NUL byte", k)
		}
	}
	if len(h.GetSiteId()) > maxIDLen {
		return fmt.Errorf("hello.site_id longer than %d bytes", maxIDLen)
	}
	if strings.ContainsRune(h.GetSiteId(), 0) || strings.ContainsRune(h.GetDaemonVersion(), 0) {
		return errors.New("hello.site_id and hello.daemon_version must not hold a NUL byte")
	}
	return nil
}

func kindName(k nodev1.NodeKind) string {
	if k == nodev1.NodeKind_NODE_KIND_SITE_AGENT {
		return "site_agent"
	}
	return "node"
}

type replay struct {
	cmd       *nodev1.Command
	createdAt time.Time
}

// hello authenticates the node and, in one transaction fenced on the
// gateway lease, bumps its session epoch, routes it here, marks it
// connected and takes its in-flight commands for replay.
func (g *Gateway) hello(ctx context.Context, stream *connect.BidiStream[nodev1.ConnectRequest, nodev1.ConnectResponse], h *nodev1.Hello) (*session, *nodev1.Welcome, []*nodev1.Command, error) {
	id, err := nodeauth.Verify(ctx, g.db, h.GetNodeId(), h.GetCredential())
	if errors.Is(err, nodeauth.ErrUnauthenticated) {
		g.m.hellos.WithLabelValues("unauthenticated").Inc()
		return nil, nil, nil, connect.NewError(connect.CodeUnauthenticated, errBadCredential)
	}
	if err != nil {
		g.m.hellos.WithLabelValues("error").Inc()
		g.log.Warn("verify node credential", "node", h.GetNodeId(), "err", err)
		return nil, nil, nil, connect.NewError(connect.CodeUnavailable, errors.New("gateway cannot reach its database"))
	}
	if kindName(h.GetKind()) != id.Kind {
		g.m.hellos.WithLabelValues("refused").Inc()
		return nil, nil, nil, connect.NewError(connect.CodePermissionDenied, fmt.Errorf("hello.kind %s does not match the registered kind %s", kindName(h.GetKind()), id.Kind))
	}
	if h.GetSiteId() != "" && h.GetSiteId() != id.SiteID {
		g.m.hellos.WithLabelValues("refused").Inc()
		return nil, nil, nil, connect.NewError(connect.CodePermissionDenied, fmt.Errorf("hello.site_id %q does not match the registered site", h.GetSiteId()))
	}
	labels, err := json.Marshal(h.GetLabels())
	if err != nil {
		return nil, nil, nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	if h.GetLabels() == nil {
		labels = []byte("{}")
	}

	var (
		epoch   int64
		specRaw []byte
		specVer int64
		replays []replay
		revoked bool
	)
	err = g.runFenced(ctx, func(ctx context.Context, tx pgx.Tx) error {
		replays = replays[:0]
		if err := tx.QueryRow(ctx, helloSessionSQL, h.GetNodeId(), g.id, g.cfg.SessionLease.Seconds()).Scan(&epoch); err != nil {
			return fmt.Errorf("route node: %w", err)
		}
		err := tx.QueryRow(ctx, helloNodeSQL, h.GetNodeId(), epoch, h.GetDaemonVersion(), string(labels)).Scan(&specRaw, &specVer)
		if errors.Is(err, pgx.ErrNoRows) {
			revoked = true
			return err
		}
		if err != nil {
			return fmt.Errorf("mark node connected: %w", err)
		}
		rows, err := tx.Query(ctx, helloReplaySQL, h.GetNodeId(), h.GetInFlightCommandIds(), g.id, epoch)
		if err != nil {
			return fmt.Errorf("select in-flight commands: %w", err)
		}
		defer rows.Close()
		var failed []undeliverable
		for rows.Next() {
			var (
				c        nodev1.Command
				deadline *time.Time
				created  time.Time
			)
			if err := rows.Scan(&c.CommandId, &c.Kind, &c.Payload, &deadline, &c.DispatchCount, &created); err != nil {
				return fmt.Errorf("scan in-flight command: %w", err)
			}
			if deadline != nil {
				c.Deadline = timestamppb.New(*deadline)
			}
			if why := g.undeliverableReason(&c); why != "" {
				// Sending it would end the session, and the next Hello
				// would replay it again: it fails here instead.
				failed = append(failed, undeliverable{id: c.CommandId, nodeID: h.GetNodeId(), epoch: epoch, reason: why})
				continue
			}
			replays = append(replays, replay{cmd: &c, createdAt: created})
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return fmt.Errorf("select in-flight commands: %w", err)
		}
		return failUndeliverable(ctx, tx, g.id, failed)
	})
	if revoked {
		g.m.hellos.WithLabelValues("unauthenticated").Inc()
		return nil, nil, nil, connect.NewError(connect.CodeUnauthenticated, errBadCredential)
	}
	if err != nil {
		g.m.hellos.WithLabelValues("error").Inc()
		if g.Fenced() {
			return nil, nil, nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("gateway %s fenced itself", g.id))
		}
		g.log.Warn("hello transaction", "node", h.GetNodeId(), "err", err)
		return nil, nil, nil, connect.NewError(connect.CodeUnavailable, errors.New("hello could not be recorded; retry"))
	}
	spec := &nodev1.NodeSpec{}
	if len(specRaw) > 0 {
		if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(specRaw, spec); err != nil {
			g.log.Warn("node spec is not a NodeSpec; sending an empty one", "node", h.GetNodeId(), "err", err)
			spec = &nodev1.NodeSpec{}
		}
	}
	slices.SortFunc(replays, func(a, b replay) int { return a.createdAt.Compare(b.createdAt) })
	cmds := make([]*nodev1.Command, len(replays))
	for i, r := range replays {
		cmds[i] = r.cmd
	}
	body, _ := ctx.Value(bodyKey{}).(io.Closer)
	budget := int64(g.cfg.MaxMessageBytes)
	s := &session{nodeID: h.GetNodeId(), epoch: epoch, window: g.cfg.NodeWindow,
		reports: semaphore.NewWeighted(budget), reportBudget: budget, output: semaphore.NewWeighted(sessionOutputBudget),
		send: stream.Send, breakRecv: func() {
			if body != nil {
				_ = body.Close()
			}
		}}
	if _, ok := body.(readableBody); ok {
		s.inline, s.wake = true, make(chan struct{}, 1)
	}
	s.touch(g.clock.Now())
	s.specVersion.Store(specVer)
	welcome := &nodev1.Welcome{
		SessionEpoch: epoch, Spec: spec, GatewayId: g.id,
		HeartbeatInterval: durationpb.New(g.cfg.HeartbeatInterval),
	}
	g.m.hellos.WithLabelValues("welcomed").Inc()
	return s, welcome, cmds, nil
}

// serveSession sends Welcome and the replays, registers the session so
// dispatch can reach it, and reads the node's messages until the stream
// ends or the session is closed.
func (g *Gateway) serveSession(ctx context.Context, stream *connect.BidiStream[nodev1.ConnectRequest, nodev1.ConnectResponse], s *session, welcome *nodev1.Welcome, replays []*nodev1.Command) error {
	body, _ := ctx.Value(bodyKey{}).(readableBody)
	ctx, stopWaits := context.WithCancel(ctx)
	defer stopWaits()
	s.stopWaits = stopWaits
	msgs := make([]*nodev1.ConnectResponse, 0, 1+len(replays))
	msgs = append(msgs, &nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Welcome{Welcome: welcome}})
	for _, c := range replays {
		msgs = append(msgs, &nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Command{Command: c}})
		s.sending(c.GetCommandId()) // replays count into the window, even past it
	}
	s.enqueue(msgs...)
	g.m.replayed.Add(float64(len(replays)))

	g.mu.Lock()
	old := g.sessions[s.nodeID]
	g.sessions[s.nodeID] = s
	g.m.sessions.Set(float64(len(g.sessions)))
	g.mu.Unlock()
	if old != nil {
		g.m.zombies.Inc()
		old.close(connect.NewError(connect.CodeUnavailable, fmt.Errorf("node %s said Hello again (epoch %d supersedes %d)", s.nodeID, s.epoch, old.epoch)))
	}
	if g.Fenced() || g.generation.Load() != s.generation { // fenced between the Hello and registration
		s.close(connect.NewError(connect.CodeUnavailable, fmt.Errorf("gateway %s fenced itself", g.id)))
	}
	g.wakeDispatch(s.nodeID)
	g.wakeSpec(s.nodeID) // a spec changed between the Hello and registration
	g.log.Debug("session opened", "node", s.nodeID, "epoch", s.epoch, "replayed", len(replays))

	var (
		streamErr *connect.Error
		readable  <-chan struct{}
	)
	for {
		if s.inline {
			if s.sendQueued() != nil {
				break
			}
			if readable == nil {
				readable = body.WaitReadable()
			}
			select {
			case <-s.wake:
				continue
			case <-readable:
				readable = nil
			}
		}
		req, err := stream.Receive()
		if err != nil {
			if !errors.Is(err, io.EOF) && !s.isClosed() {
				var ce *connect.Error
				if errors.As(err, &ce) && ce.Code() == connect.CodeResourceExhausted {
					streamErr = ce
				}
			}
			break
		}
		s.touch(g.clock.Now())
		if cerr := g.handleMessage(ctx, s, req); cerr != nil {
			streamErr = cerr
			break
		}
	}
	reason := s.finish()
	g.killTunnelsOf(s, "stream closed")
	g.mu.Lock()
	mine := g.sessions[s.nodeID] == s
	if mine {
		delete(g.sessions, s.nodeID)
	}
	g.m.sessions.Set(float64(len(g.sessions)))
	g.mu.Unlock()
	if mine && !g.Fenced() && s.generation == g.generation.Load() {
		g.markDisconnected(s) // a session of a holding fenced since writes nothing
	}
	g.log.Debug("session closed", "node", s.nodeID, "epoch", s.epoch, "reason", reason, "err", streamErr)
	if streamErr != nil {
		return streamErr
	}
	if reason != nil {
		return reason
	}
	return nil
}

// markDisconnected records a stream that ended, only at the session's
// epoch, so a newer Hello anywhere is never overwritten.
func (g *Gateway) markDisconnected(s *session) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := g.runFenced(ctx, func(ctx context.Context, tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, closeSessionSQL, s.nodeID, s.epoch, g.id)
		if err != nil || tag.RowsAffected() == 0 {
			return err
		}
		_, err = tx.Exec(ctx, closeNodeSQL, s.nodeID, s.epoch)
		return err
	})
	if err != nil && !g.Fenced() {
		g.log.Warn("mark session disconnected", "node", s.nodeID, "epoch", s.epoch, "err", err)
	}
}

// handleMessage handles one message after Hello; a non-nil error closes
// the stream with that code.
func (g *Gateway) handleMessage(ctx context.Context, s *session, req *nodev1.ConnectRequest) *connect.Error {
	switch m := req.GetMsg().(type) {
	case *nodev1.ConnectRequest_Hello:
		return connect.NewError(connect.CodeFailedPrecondition, errSecondHello)
	case *nodev1.ConnectRequest_Heartbeat:
		// A HeartbeatAck still means every result sent before the
		// Heartbeat is stored, as when each result was awaited in turn.
		if err := s.settled(ctx); err != nil {
			return connect.NewError(connect.CodeCanceled, err)
		}
		s.enqueue(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_HeartbeatAck{
			HeartbeatAck: &nodev1.HeartbeatAck{Sequence: m.Heartbeat.GetSequence()},
		}})
		return nil
	case *nodev1.ConnectRequest_CommandAck:
		return g.handleAck(ctx, s, m.CommandAck)
	case *nodev1.ConnectRequest_CommandResult:
		return g.handleResult(ctx, s, m.CommandResult)
	case *nodev1.ConnectRequest_Event:
		return g.handleEvent(ctx, s, m.Event)
	case *nodev1.ConnectRequest_CommandOutput:
		return g.handleOutput(ctx, s, m.CommandOutput)
	case *nodev1.ConnectRequest_CancelAck:
		return g.handleCancelAck(s, m.CancelAck)
	default:
		return connect.NewError(connect.CodeInvalidArgument, errors.New("empty or unknown message"))
	}
}

func dbError(op string, err error) *connect.Error {
	if errors.Is(err, context.Canceled) {
		return connect.NewError(connect.CodeCanceled, err)
	}
	if permanentDBError(err) {
		// Resending it would be refused again.
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s refused by the database (%s); do not resend it", op, pgMessage(err)))
	}
	return connect.NewError(connect.CodeUnavailable, fmt.Errorf("%s could not be recorded; reconnect and resend", op))
}

// handleAck queues the ack for the group commit and does not wait for it
// (ingest.go): a refused ack closes the session later.
func (g *Gateway) handleAck(_ context.Context, s *session, a *nodev1.CommandAck) *connect.Error {
	id := a.GetCommandId()
	if id == "" || len(id) > maxIDLen || strings.ContainsRune(id, 0) {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("command_ack.command_id must be 1..%d bytes without NUL", maxIDLen))
	}
	g.ingest.submit(&ingestItem{kind: ingestAck, s: s, id: id})
	return nil
}

// handleResult queues the result for the group commit and returns without
// waiting for it, so the node's next messages are read while it commits;
// the session's report budget (session.reports) bounds what is queued.
// When the write fails the session is closed UNAVAILABLE, so the node
// redials and, its command still in flight, resends the result on replay;
// a result for another node's command closes it PERMISSION_DENIED.
func (g *Gateway) handleResult(ctx context.Context, s *session, r *nodev1.CommandResult) *connect.Error {
	if r.GetCommandId() == "" || len(r.GetCommandId()) > maxIDLen || r.GetResultId() == "" || len(r.GetResultId()) > maxIDLen ||
		strings.ContainsRune(r.GetCommandId(), 0) || strings.ContainsRune(r.GetResultId(), 0) {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("command_result.command_id and result_id must be 1..%d bytes without NUL", maxIDLen))
	}
	if s.answered(r.GetCommandId()) {
		// Its window was full: dispatch may send the node the next one
		// while this result commits.
		g.wakeDispatch(s.nodeID)
	}
	// An old or foreign daemon may send an error PostgreSQL's text refuses.
	it := &ingestItem{kind: ingestResult, s: s, id: r.GetResultId(), command: r.GetCommandId(),
		exitCode: r.GetExitCode(), output: r.GetOutput(), errText: sanitizeText(r.GetError())}
	if r.GetStartedAt() != nil {
		t := r.GetStartedAt().AsTime()
		it.started = &t
	}
	if r.GetFinishedAt() != nil {
		t := r.GetFinishedAt().AsTime()
		it.finished = &t
	}
	if it.output == nil {
		it.output = []byte{}
	}
	w := reportWeight(len(it.output), s.reportBudget, s.window)
	if err := s.reports.Acquire(ctx, w); err != nil {
		return connect.NewError(connect.CodeCanceled, err)
	}
	select {
	case <-g.ingest.stopped:
		s.reports.Release(w)
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("gateway %s is stopping; reconnect and resend", g.id))
	default:
	}
	start := spanStart()
	it.onDone = func(o ingestOutcome) {
		s.reports.Release(w)
		g.resultStored(ctx, s, r, start, o)
	}
	g.ingest.submit(it)
	return nil
}

// resultStored acts on the group commit's answer for a result: it runs on
// the ingest goroutine, so it only counts, traces, logs and closes.
func (g *Gateway) resultStored(ctx context.Context, s *session, r *nodev1.CommandResult, start time.Time, o ingestOutcome) {
	g.traceResult(ctx, s, r, o.traceparent, start, o.outcome, o.err)
	if o.err != nil {
		s.close(dbError("command result", o.err))
		return
	}
	g.m.results.WithLabelValues(o.outcome).Inc()
	switch o.outcome {
	case "refused":
		// The protocol reports a bad message by ending the stream; the
		// command is failed already, so the node's next Hello does not
		// replay it and its result is not sent again.
		s.close(connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("command %s: %s; the command is failed", r.GetCommandId(), o.refusal)))
	case "denied":
		s.close(connect.NewError(connect.CodePermissionDenied, fmt.Errorf("command %s belongs to another node", r.GetCommandId())))
	case "unknown":
		g.log.Warn("result for an unknown command dropped", "node", s.nodeID, "command", r.GetCommandId())
	}
}

func (g *Gateway) handleEvent(ctx context.Context, s *session, e *nodev1.Event) *connect.Error {
	if e.GetEventId() == "" || len(e.GetEventId()) > maxIDLen || e.GetKind() == "" || len(e.GetKind()) > maxKindLen ||
		strings.ContainsRune(e.GetEventId(), 0) || strings.ContainsRune(e.GetKind(), 0) {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("event.event_id must be 1..%d bytes and event.kind 1..%d, without NUL", maxIDLen, maxKindLen))
	}
	if e.GetBootEpoch() > 1<<62 {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("event.boot_epoch out of range"))
	}
	payload := []byte("{}")
	if e.GetPayload() != nil {
		b, err := protojson.Marshal(e.GetPayload())
		if err != nil {
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("event.payload: %w", err))
		}
		payload = b
	}
	var occurred *time.Time
	if e.GetOccurredAt() != nil {
		t := e.GetOccurredAt().AsTime()
		occurred = &t
	}
	if e.GetKind() != DiscoveryEventKind {
		it := &ingestItem{kind: ingestEvent, s: s, id: e.GetEventId(), eventKind: e.GetKind(), payload: string(payload),
			occurred: occurred, bootEpoch: int64(e.GetBootEpoch()), done: make(chan ingestOutcome, 1)}
		outcome, cerr := g.await(ctx, it, "event")
		if cerr != nil {
			return cerr
		}
		g.m.events.WithLabelValues(outcome).Inc()
		return nil
	}
	// A discovery is written alone: it is vouched for by the boot lease.
	var (
		tag     pgconn.CommandTag
		refused bool
	)
	err := pgdb.InTx(ctx, g.db, func(tx pgx.Tx) error {
		if e.GetKind() == DiscoveryEventKind {
			// A discovery is vouched for by the agent's boot epoch: store it
			// only while the agent holds site:<id>:boot at that epoch.
			var epoch int64
			err := tx.QueryRow(ctx, discoveryVouchSQL, s.nodeID, int64(e.GetBootEpoch())).Scan(&epoch)
			if errors.Is(err, pgx.ErrNoRows) {
				refused = true
				return nil
			}
			if err != nil {
				return err
			}
		}
		var err error
		tag, err = tx.Exec(ctx, insertEventSQL, s.nodeID, e.GetEventId(), e.GetKind(), string(payload), occurred, g.id, s.epoch, int64(e.GetBootEpoch()))
		return err
	})
	if err != nil {
		return dbError("event", err)
	}
	if refused {
		g.m.events.WithLabelValues("refused").Inc()
		g.log.Info("discovery report refused: its boot epoch is not the agent's current boot lease epoch",
			"node", s.nodeID, "event", e.GetEventId(), "boot_epoch", e.GetBootEpoch())
		return nil
	}
	if tag.RowsAffected() == 0 {
		g.m.events.WithLabelValues("duplicate").Inc()
	} else {
		g.m.events.WithLabelValues("stored").Inc()
	}
	return nil
}
