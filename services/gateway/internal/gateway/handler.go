package gateway

// The stream loop of a node session: Connect takes a stream through
// admission (admission.go) and its Hello (hello.go), then serveSession
// reads the node's messages and hands each to its handler.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"google.golang.org/protobuf/encoding/protojson"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

type pgxTx = pgx.Tx

var (
	errSlowNode    = errors.New("node does not read its stream: too many queued messages")
	errSecondHello = errors.New("a stream carries exactly one Hello; this one already said Hello")
)

// Limits on what a node may send after its Hello, beside the message size
// limit.
const (
	maxIDLen   = 200
	maxKindLen = 100
)

// readableBody is a request body that says when Read would not block
// (h2serve's).
type readableBody interface {
	WaitReadable() <-chan struct{}
}

// Connect serves one node stream (nodev1connect.NodeGatewayServiceHandler).
func (g *Gateway) Connect(ctx context.Context, stream *connect.BidiStream[nodev1.ConnectRequest, nodev1.ConnectResponse]) error {
	n := g.streams.Add(1)
	g.m.streams.Set(float64(n))
	defer func() { g.m.streams.Set(float64(g.streams.Add(-1))) }()

	if err := g.admitStream(stream, n); err != nil {
		return err
	}
	hello, err := g.readHello(ctx, stream)
	if err != nil {
		return err
	}
	if err := g.authenticate(ctx, stream, hello); err != nil {
		return err
	}
	if err := g.admitHello(ctx, stream); err != nil {
		return err
	}
	// The Hello's database work runs detached from the stream, bounded, so
	// a client vanishing mid-Hello cannot abort it half-way.
	helloCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), helloWorkTimeout)
	gen := g.generation.Load()
	s, welcome, replays, err := g.hello(helloCtx, stream, hello)
	cancel()
	g.helloDone()
	if err != nil {
		return err
	}
	if ctx.Err() != nil {
		// The daemon stopped waiting (its Welcome timeout) while the
		// transaction ran, and has redialled or will: registering this
		// stream would only close its newer session on this gateway.
		g.m.hellos.WithLabelValues("abandoned").Inc()
		return connect.NewError(connect.CodeCanceled, fmt.Errorf("node %s went away before its Welcome", hello.GetNodeId()))
	}
	g.m.hellos.WithLabelValues("welcomed").Inc()
	s.generation = gen
	return g.serveSession(ctx, stream, s, welcome, replays)
}

// serveSession sends Welcome and the replays, registers the session so
// dispatch can reach it, and reads the node's messages until the stream
// ends or the session is closed.
func (g *Gateway) serveSession(ctx context.Context, stream *connect.BidiStream[nodev1.ConnectRequest, nodev1.ConnectResponse], s *session, welcome *nodev1.Welcome, replays []*nodev1.Command) error {
	body, _ := ctx.Value(bodyKey{}).(readableBody)
	ctx, stopWaits := context.WithCancel(ctx)
	defer stopWaits()
	s.stopWaits = stopWaits
	if !g.registerSession(s, welcome, replays) {
		if reason := s.finish(); reason != nil {
			return reason
		}
		return connect.NewError(connect.CodeUnavailable, errors.New("a newer session of this node is registered"))
	}

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
	g.watchers.endSession(s)
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
		if at := m.Heartbeat.GetSentAt(); at.IsValid() {
			g.observeSkew(s, at.AsTime(), g.clock.Now())
		}
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
	s.acknowledged(id)
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
	// Every piece of its output was read before the result: its watchers
	// have had all of it.
	g.watchers.finish(s, r.GetCommandId(), s.outputFinished(r.GetCommandId()))
	g.resultsRead.Add(1)
	if s.answered(r.GetCommandId(), g.clock.Now()) {
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
