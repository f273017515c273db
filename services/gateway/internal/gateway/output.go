package gateway

import (
	"context"
	"errors"
	"fmt"

	"connectrpc.com/connect"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// Live output (docs/gateway.md, "Live output"): a CommandOutput piece goes
// through the group commit (ingest.go) like an ack, not waited for, so a
// chatty command does not hold its session's read loop for a commit per
// piece. The queue is FIFO and a result is waited for, so every piece the
// node sent before its result is committed no later than the result: a
// reader that sees the command finished has all of its stored output.
//
// The cap (--gateway.output-cap) is applied here, before a piece is
// queued: bytes past it are dropped and the piece that crosses it, or the
// first one past it, carries the truncation marker; the statement cuts at
// the cap too, for pieces of a session that forgot its marks. What one
// session has queued and not yet stored is bounded by sessionOutputBudget:
// past it the read loop waits for the group commit, so HTTP/2 flow control
// holds the node back (docs/decisions.md, "Bounded live output").

// maxOutputPiece bounds one CommandOutput's data (the daemon sends 64 KiB).
const maxOutputPiece = 256 << 10

// outputStreams maps the proto's streams to command_output.stream.
var outputStreams = map[nodev1.OutputStream]string{
	nodev1.OutputStream_OUTPUT_STREAM_STDOUT: "stdout",
	nodev1.OutputStream_OUTPUT_STREAM_STDERR: "stderr",
}

func (g *Gateway) handleOutput(ctx context.Context, s *session, o *nodev1.CommandOutput) *connect.Error {
	if err := validateOutput(o); err != nil {
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	if len(o.GetData()) == 0 {
		return nil
	}
	s.outputRead(o.GetCommandId(), o.GetOffset()+int64(len(o.GetData())))
	it := &ingestItem{kind: ingestOutput, s: s, command: o.GetCommandId(), offset: o.GetOffset(),
		stream: outputStreams[o.GetStream()], output: o.GetData()}
	if capped := g.cfg.OutputCap; it.offset+int64(len(it.output)) > capped {
		keep := max(0, capped-it.offset)
		// The part not stored goes to the command's live watchers (watch.go).
		past := o
		if keep > 0 {
			past = &nodev1.CommandOutput{CommandId: o.GetCommandId(), Offset: o.GetOffset() + keep, Stream: o.GetStream(), Data: o.GetData()[keep:]}
		}
		g.watchers.publish(ctx, s, past)
		g.m.outputBytes.WithLabelValues("dropped").Add(float64(int64(len(it.output)) - keep))
		if s.outputMarked(it.command) {
			if keep == 0 {
				return nil // past the cap, and the marker is queued already
			}
		}
		it.output, it.truncated = it.output[:keep], true
		if keep == 0 {
			it.offset, it.stream = capped, "truncated"
		}
	}
	w := int64(len(it.output))
	if err := s.awaitOutputRoom(ctx, w); err != nil {
		return connect.NewError(connect.CodeCanceled, err)
	}
	g.outputQueued(w)
	g.ingest.submit(it)
	return nil
}

// outputMarked records that id's truncation marker is queued on s and
// says whether it already was. The marks are bounded: past maxOutputMarks
// they are forgotten (a marker queued twice is stored once).
func (s *session) outputMarked(id string) bool {
	if _, ok := s.marked[id]; ok {
		return true
	}
	if len(s.marked) >= maxOutputMarks {
		clear(s.marked)
	}
	if s.marked == nil {
		s.marked = make(map[string]struct{})
	}
	s.marked[id] = struct{}{}
	return false
}

// maxOutputMarks bounds the truncation marks a session remembers.
const maxOutputMarks = 1024

// awaitOutputRoom takes n bytes of the session's output budget, waiting
// for the group commit to store earlier pieces if it is spent. While it
// waits the read loop reads nothing, which HTTP/2 flow control turns into
// backpressure on the node; the session counts as alive meanwhile (the
// node is sending, the gateway is not reading).
func (s *session) awaitOutputRoom(ctx context.Context, n int64) error {
	if s.output.TryAcquire(n) {
		return nil
	}
	s.heldBack.Store(true)
	defer s.heldBack.Store(false)
	if err := s.output.Acquire(ctx, n); err != nil {
		return fmt.Errorf("wait for the session's output budget: %w", err)
	}
	return nil
}

// outputQueued adds n (negative: answered) to the queued output bytes and
// keeps their peak.
func (g *Gateway) outputQueued(n int64) {
	v := g.queuedOutput.Add(n)
	for {
		p := g.queuedOutputPeak.Load()
		if v <= p || g.queuedOutputPeak.CompareAndSwap(p, v) {
			return
		}
	}
}

func validateOutput(o *nodev1.CommandOutput) error {
	if id := o.GetCommandId(); id == "" || len(id) > maxIDLen {
		return fmt.Errorf("command_output.command_id must be 1..%d bytes", maxIDLen)
	}
	if o.GetOffset() < 0 || o.GetOffset() > 1<<50 {
		return errors.New("command_output.offset must be in 0..2^50")
	}
	if _, ok := outputStreams[o.GetStream()]; !ok {
		return errors.New("command_output.stream must be OUTPUT_STREAM_STDOUT or OUTPUT_STREAM_STDERR")
	}
	if len(o.GetData()) > maxOutputPiece {
		return fmt.Errorf("command_output.data is %d bytes, more than %d", len(o.GetData()), maxOutputPiece)
	}
	return nil
}

// answerUnwaited handles the outcome of an output piece or cancel ack,
// which nobody waits for: a piece or ack for another node's command closes
// the session PERMISSION_DENIED; a failed write is logged (a lost piece is
// a gap in the stored output; a lost cancel ack is asked for again after
// the next Hello).
func (g *Gateway) answerUnwaited(it *ingestItem, o ingestOutcome) {
	what := "command output"
	if it.kind == ingestOutput {
		g.outputQueued(-int64(len(it.output)))
		it.s.output.Release(int64(len(it.output)))
	}
	if it.kind == ingestCancelAck {
		what = "cancel ack"
	}
	switch {
	case o.err != nil:
		if !errors.Is(o.err, context.Canceled) {
			g.log.Warn(what+" not recorded", "node", it.s.nodeID, "command", it.command+it.id, "err", o.err)
		}
		if it.kind == ingestOutput {
			g.m.outputBytes.WithLabelValues("dropped").Add(float64(len(it.output)))
		}
	case it.kind == ingestOutput && o.outcome == "unknown":
		g.m.outputBytes.WithLabelValues("dropped").Add(float64(len(it.output)))
	case o.outcome == "denied":
		if it.kind == ingestOutput {
			g.m.outputBytes.WithLabelValues("dropped").Add(float64(len(it.output)))
		}
		it.s.close(connect.NewError(connect.CodePermissionDenied, fmt.Errorf("%s for command %s, which belongs to another node", what, it.command+it.id)))
	case it.kind == ingestOutput && o.outcome == "capped":
		kept := max(0, min(int64(len(it.output)), g.cfg.OutputCap-it.offset))
		g.m.outputBytes.WithLabelValues("stored").Add(float64(kept))
		g.m.outputBytes.WithLabelValues("dropped").Add(float64(int64(len(it.output)) - kept))
	case it.kind == ingestOutput:
		g.m.outputBytes.WithLabelValues("stored").Add(float64(len(it.output)))
	case it.kind == ingestCancelAck && o.outcome == "ok":
		g.m.cancels.WithLabelValues("confirmed").Inc()
	}
}

// sessionOutputBudget bounds the live output bytes one session may have
// queued for the group commit and not yet stored (a multiple of
// maxOutputPiece, so any piece fits).
const sessionOutputBudget = 4 << 20
