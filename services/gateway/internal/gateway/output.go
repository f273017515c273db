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
// reader that sees the command finished has all of its stored output. The
// cap (--gateway.output-cap) is applied in the statement.

// maxOutputPiece bounds one CommandOutput's data (the daemon sends 64 KiB).
const maxOutputPiece = 256 << 10

// outputStreams maps the proto's streams to command_output.stream.
var outputStreams = map[nodev1.OutputStream]string{
	nodev1.OutputStream_OUTPUT_STREAM_STDOUT: "stdout",
	nodev1.OutputStream_OUTPUT_STREAM_STDERR: "stderr",
}

func (g *Gateway) handleOutput(s *session, o *nodev1.CommandOutput) *connect.Error {
	if err := validateOutput(o); err != nil {
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	if len(o.GetData()) == 0 {
		return nil
	}
	g.ingest.submit(&ingestItem{kind: ingestOutput, s: s, command: o.GetCommandId(), offset: o.GetOffset(),
		stream: outputStreams[o.GetStream()], output: o.GetData()})
	return nil
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
