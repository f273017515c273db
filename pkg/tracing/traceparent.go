package tracing

import (
	"context"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Traceparent is the W3C traceparent header of the span in ctx, or "" when
// ctx carries no valid span context (tracing off, or no span started). An
// unsampled span gives a traceparent with the sampled flag clear, so spans
// started from it later are not sampled either.
func Traceparent(ctx context.Context) string {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return ""
	}
	c := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(ctx, c)
	return c["traceparent"]
}

// WithTraceparent returns ctx carrying the remote span context of a stored
// traceparent, so spans started from it are its children. A malformed or
// empty traceparent leaves ctx as it is.
func WithTraceparent(ctx context.Context, traceparent string) context.Context {
	if traceparent == "" {
		return ctx
	}
	return propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier{"traceparent": traceparent})
}

// TracerProvider returns tp, or the global provider when tp is nil (a no-op
// unless Setup turned tracing on).
func TracerProvider(tp trace.TracerProvider) trace.TracerProvider {
	if tp != nil {
		return tp
	}
	return otelGlobal()
}
