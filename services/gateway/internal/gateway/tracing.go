package gateway

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/tracing"
)

// tracerName is the instrumentation scope of the gateway's spans.
const tracerName = "github.com/leasehold/leasehold/services/gateway"

// Span names of a traced command's life in the gateway. Each is a child of
// the CreateCommand call whose traceparent the api stored with the
// command; commands created untraced get no spans (the gateway's loops
// start no root traces).
const (
	spanDispatch = "leasehold.gateway.dispatch"
	spanResult   = "leasehold.gateway.result"
)

// traceDispatch records the dispatch of d, from the start of its fenced
// transaction to the hand-off to the session's writer.
func (g *Gateway) traceDispatch(ctx context.Context, d dispatched, start time.Time, sent bool) {
	if d.traceparent == nil {
		return
	}
	_, span := g.tracer.Start(tracing.WithTraceparent(ctx, *d.traceparent), spanDispatch,
		trace.WithSpanKind(trace.SpanKindProducer), trace.WithTimestamp(start),
		trace.WithAttributes(
			attribute.String("leasehold.command.id", d.cmd.GetCommandId()),
			attribute.String("leasehold.command.kind", d.cmd.GetKind()),
			attribute.String("leasehold.node.id", d.nodeID),
			attribute.String("leasehold.gateway.id", g.id),
			attribute.Int64("leasehold.session.epoch", d.epoch),
			attribute.Int64("leasehold.command.dispatch_count", int64(d.cmd.GetDispatchCount())),
			attribute.Bool("leasehold.command.sent", sent),
		))
	if !sent {
		span.SetStatus(codes.Error, "no open stream: replayed on the next Hello")
	}
	span.End()
}

// traceResult records the storing of a node's result for a traced command.
func (g *Gateway) traceResult(ctx context.Context, s *session, r *nodev1.CommandResult, traceparent *string, start time.Time, outcome string, err error) {
	if traceparent == nil {
		return
	}
	_, span := g.tracer.Start(tracing.WithTraceparent(ctx, *traceparent), spanResult,
		trace.WithSpanKind(trace.SpanKindConsumer), trace.WithTimestamp(start),
		trace.WithAttributes(
			attribute.String("leasehold.command.id", r.GetCommandId()),
			attribute.String("leasehold.node.id", s.nodeID),
			attribute.String("leasehold.gateway.id", g.id),
			attribute.Int64("leasehold.command.exit_code", int64(r.GetExitCode())),
			attribute.String("leasehold.result.outcome", outcome),
		))
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, "store result")
	} else if r.GetExitCode() != 0 || r.GetError() != "" {
		span.SetStatus(codes.Error, "command failed on the node")
	}
	span.End()
}

// spanStart is a span's start time. It reads the wall clock, not the
// injected one: OpenTelemetry stamps the span's end with the wall clock, so
// a start from a fake or scaled clock would give the span a false length.
func spanStart() time.Time {
	return time.Now()
}
