package gateway

// The Hello: reading and validating a stream's first message, the checks
// that cost nothing (the client certificate's node, the daemon version),
// authentication, which comes before the Hello may spend any admission
// (admission.go), the Hello transaction, and registering the session it
// opens.

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
	"golang.org/x/sync/semaphore"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/nodeauth"
	"github.com/leasehold/leasehold/pkg/nodereg"
)

var (
	errFirstNotHello = errors.New("the first message of a stream must be a Hello")
	errBadCredential = errors.New("node credential not accepted")
)

// Limits on a Hello, beside the message size limit and maxIDLen.
const (
	maxInFlightIDs  = 10000
	maxLabels       = 64
	maxLabelLen     = 256
	maxVersionLen   = 100
	maxCredentialSz = nodeauth.MaxCredentialLen
)

// helloWorkTimeout bounds the Hello's credential check and transaction.
const helloWorkTimeout = 15 * time.Second

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

// readHello receives the stream's Hello and passes it through the checks
// that cost no database work: it is the first message, it is well formed,
// its node is the one the client certificate names (when bound), and its
// daemon is recent enough. A refusal is counted and returned.
func (g *Gateway) readHello(ctx context.Context, stream *connect.BidiStream[nodev1.ConnectRequest, nodev1.ConnectResponse]) (*nodev1.Hello, error) {
	first, err := g.receiveHello(ctx, stream)
	if err != nil {
		g.helloRefused("refused", "no-hello")
		return nil, err
	}
	hello := first.GetHello()
	if hello == nil {
		g.helloRefused("refused", "no-hello")
		return nil, connect.NewError(connect.CodeInvalidArgument, errFirstNotHello)
	}
	if err := validateHello(hello); err != nil {
		g.helloRefused("refused", "invalid")
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	// Before the admission token, the credential and any database access.
	if g.bindsNodeID() {
		cs, _ := ctx.Value(tlsStateKey{}).(*tls.ConnectionState)
		if err := certNodeError(cs, hello.GetNodeId()); err != nil {
			g.helloRefused("refused", "cert-node")
			g.log.Warn("hello refused: node id not bound to the client certificate", "peer", stream.Peer().Addr, "err", err)
			return nil, err
		}
	}
	// Before the admission token too: the check is free, and an old
	// fleet's dials should not use up the Hello rate of current daemons.
	if why := versionRefusal(hello.GetDaemonVersion(), g.minDaemonVersion); why != "" {
		g.log.Info("hello refused: daemon version", "node", hello.GetNodeId(), "daemon_version", hello.GetDaemonVersion(), "min", g.minDaemonVersion)
		return nil, g.refuse(stream, "daemon-version", versionRetryAfter(), connect.CodeFailedPrecondition, why)
	}
	return hello, nil
}

// helloRefused counts a Hello refused for good: outcome in
// leasehold_gateway_hellos_total, reason in
// leasehold_gateway_hello_refusals_total.
func (g *Gateway) helloRefused(outcome, reason string) {
	g.m.hellos.WithLabelValues(outcome).Inc()
	g.m.helloRefusals.WithLabelValues(reason).Inc()
}

// authenticate checks the Hello's credential, and the kind and site the
// node was registered with, before the Hello may spend anything the fleet
// shares: the handshake bucket's token and a Hello transaction slot are
// taken (admitHello) only by an authenticated node, so dials with bad
// credentials, however many, never push back a good one.
//
// What such a dial can cost is bounded instead: a credential that is not
// shaped like one is refused without the database, and the check itself,
// one indexed read, runs under MaxPendingAuths. A Hello that finds every
// check slot busy waits its turn (first come, first served) for up to
// HelloTimeout rather than being pushed back, so a flood can delay a good
// Hello by the checks queued ahead of it, never refuse it.
func (g *Gateway) authenticate(ctx context.Context, stream *connect.BidiStream[nodev1.ConnectRequest, nodev1.ConnectResponse], h *nodev1.Hello) error {
	if !nodeauth.WellFormed(h.GetCredential()) {
		g.helloRefused("unauthenticated", "credential-malformed")
		return connect.NewError(connect.CodeUnauthenticated, errBadCredential)
	}
	waitCtx, cancel := context.WithTimeout(ctx, g.cfg.HelloTimeout)
	err := g.auths.Acquire(waitCtx, 1)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return connect.NewError(connect.CodeCanceled, errors.New("stream ended while its Hello waited for a credential check"))
		}
		return g.pushback(stream, "max-pending-auths", 500*time.Millisecond+rand.N(500*time.Millisecond), connect.CodeResourceExhausted)
	}
	// Detached from the stream, as the Hello transaction is: a client
	// that vanishes mid-check does not cancel the read half-way.
	verifyCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), helloWorkTimeout)
	id, err := nodereg.Verify(verifyCtx, g.db, h.GetNodeId(), h.GetCredential())
	cancel()
	g.auths.Release(1)
	if errors.Is(err, nodereg.ErrUnauthenticated) {
		g.helloRefused("unauthenticated", "unauthenticated")
		return connect.NewError(connect.CodeUnauthenticated, errBadCredential)
	}
	if err != nil {
		g.m.hellos.WithLabelValues("error").Inc()
		g.log.Warn("verify node credential", "node", h.GetNodeId(), "err", err)
		return connect.NewError(connect.CodeUnavailable, errors.New("gateway cannot reach its database"))
	}
	if kindName(h.GetKind()) != id.Kind {
		g.helloRefused("refused", "registration")
		return connect.NewError(connect.CodePermissionDenied, fmt.Errorf("hello.kind %s does not match the registered kind %s", kindName(h.GetKind()), id.Kind))
	}
	if h.GetSiteId() != "" && h.GetSiteId() != id.SiteID {
		g.helloRefused("refused", "registration")
		return connect.NewError(connect.CodePermissionDenied, fmt.Errorf("hello.site_id %q does not match the registered site", h.GetSiteId()))
	}
	return nil
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

// hello, for a node authenticate accepted, bumps its session epoch,
// routes it here, marks it connected and takes its in-flight commands for
// replay, in one transaction fenced on the gateway lease. A node revoked
// since authenticate is refused UNAUTHENTICATED.
func (g *Gateway) hello(ctx context.Context, stream *connect.BidiStream[nodev1.ConnectRequest, nodev1.ConnectResponse], h *nodev1.Hello) (*session, *nodev1.Welcome, []*nodev1.Command, error) {
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
		g.helloRefused("unauthenticated", "unauthenticated")
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
	if ids := h.GetInFlightCommandIds(); len(ids) > 0 {
		s.heldAtHello = make(map[string]struct{}, len(ids))
		for _, id := range ids {
			s.heldAtHello[id] = struct{}{}
		}
	}
	s.touch(g.clock.Now())
	s.roomAt.Store(g.clock.Now().UnixNano())
	s.skew.Store(noSkew)
	s.specVersion.Store(specVer)
	welcome := &nodev1.Welcome{
		SessionEpoch: epoch, Spec: spec, GatewayId: g.id,
		HeartbeatInterval: durationpb.New(g.cfg.HeartbeatInterval),
	}
	return s, welcome, cmds, nil
}

// registerSession queues Welcome and the replays on s and registers it so
// dispatch can reach it, closing the session it supersedes. A session is
// never registered over a newer one of the same node (a higher epoch): two
// Hellos of one node can finish out of order (the first one slow, its
// daemon already redialled), and the older must not replace the newer. It
// returns false, with s closed, when s lost that race.
func (g *Gateway) registerSession(s *session, welcome *nodev1.Welcome, replays []*nodev1.Command) bool {
	if newer := g.newerSession(s); newer != nil {
		s.close(supersededError(s, newer))
		return false
	}
	msgs := make([]*nodev1.ConnectResponse, 0, 1+len(replays))
	msgs = append(msgs, &nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Welcome{Welcome: welcome}})
	now := g.clock.Now()
	for _, c := range replays {
		msgs = append(msgs, &nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Command{Command: c}})
		s.sending(now, c.GetCommandId()) // replays count into the window, even past it
		if _, held := s.heldAtHello[c.GetCommandId()]; held {
			// The node listed it as its own: it is running it, or has its
			// result to send again, and acknowledges it no more.
			s.acknowledged(c.GetCommandId())
		}
	}
	s.heldAtHello = nil
	s.enqueue(msgs...)
	g.m.replayed.Add(float64(len(replays)))

	g.mu.Lock()
	old := g.sessions[s.nodeID]
	if old != nil && old.epoch > s.epoch { // registered since the check above
		g.mu.Unlock()
		s.close(supersededError(s, old))
		return false
	}
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
	return true
}

// newerSession is the registered session of s's node with a higher epoch
// than s, or nil.
func (g *Gateway) newerSession(s *session) *session {
	g.mu.Lock()
	defer g.mu.Unlock()
	if old := g.sessions[s.nodeID]; old != nil && old.epoch > s.epoch {
		return old
	}
	return nil
}

// supersededError ends a session whose Hello finished after a newer one's.
func supersededError(s, newer *session) *connect.Error {
	return connect.NewError(connect.CodeUnavailable, fmt.Errorf("node %s already has a newer session (epoch %d) than this Hello's (epoch %d)", s.nodeID, newer.epoch, s.epoch))
}
