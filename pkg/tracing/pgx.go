package tracing

import (
	"context"

	"github.com/exaring/otelpgx"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"
)

func otelGlobal() trace.TracerProvider { return otel.GetTracerProvider() }

// PgxTracer returns a pgx tracer that records a span for each query, batch
// and connect, but only inside a trace already started (a traced API call,
// a command's result): the background loops of every service (lease
// renewals, dispatch polls, liveness batches) query every few hundred
// milliseconds and would otherwise each open a root trace of their own.
// SQL text is recorded; query arguments never are.
func PgxTracer(tp trace.TracerProvider) pgx.QueryTracer {
	return &parentOnly{inner: otelpgx.NewTracer(otelpgx.WithTracerProvider(TracerProvider(tp)))}
}

// parentOnly delegates to otelpgx when ctx holds a span. The start marks
// the context it delegated for, so the end of a query it skipped never ends
// the caller's span (otelpgx ends the span it finds in ctx).
type parentOnly struct{ inner *otelpgx.Tracer }

type tracedKey struct{}

func traced(ctx context.Context) bool { return trace.SpanContextFromContext(ctx).IsValid() }

func (p *parentOnly) TraceQueryStart(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if !traced(ctx) {
		return ctx
	}
	return context.WithValue(p.inner.TraceQueryStart(ctx, conn, data), tracedKey{}, true)
}

func (p *parentOnly) TraceQueryEnd(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryEndData) {
	if ctx.Value(tracedKey{}) == true {
		p.inner.TraceQueryEnd(ctx, conn, data)
	}
}

func (p *parentOnly) TraceBatchStart(ctx context.Context, conn *pgx.Conn, data pgx.TraceBatchStartData) context.Context {
	if !traced(ctx) {
		return ctx
	}
	return context.WithValue(p.inner.TraceBatchStart(ctx, conn, data), tracedKey{}, true)
}

func (p *parentOnly) TraceBatchQuery(ctx context.Context, conn *pgx.Conn, data pgx.TraceBatchQueryData) {
	if ctx.Value(tracedKey{}) == true {
		p.inner.TraceBatchQuery(ctx, conn, data)
	}
}

func (p *parentOnly) TraceBatchEnd(ctx context.Context, conn *pgx.Conn, data pgx.TraceBatchEndData) {
	if ctx.Value(tracedKey{}) == true {
		p.inner.TraceBatchEnd(ctx, conn, data)
	}
}
