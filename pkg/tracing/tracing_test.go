package tracing_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/tracing"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestEnabledOnlyByTheEnvironment(t *testing.T) {
	for _, c := range []struct {
		env  map[string]string
		want bool
	}{
		{map[string]string{}, false},
		{map[string]string{"OTEL_TRACES_EXPORTER": "none"}, false},
		{map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, true},
		{map[string]string{"OTEL_TRACES_EXPORTER": "console"}, true},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, true},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, true},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_TRACES_EXPORTER": "none"}, false},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "true"}, false},
	} {
		for _, k := range []string{"OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"} {
			t.Setenv(k, c.env[k])
		}
		require.Equal(t, c.want, tracing.Enabled(), "%v", c.env)
	}
	t.Setenv("OTEL_TRACES_EXPORTER", "")
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	p, err := tracing.Setup(context.Background(), "api", "api_1")
	require.NoError(t, err)
	require.False(t, p.Enabled)
	_, span := p.Tracer("x").Start(context.Background(), "noop")
	require.False(t, span.SpanContext().IsValid(), "off, spans are no-ops")
	require.NoError(t, p.Shutdown(context.Background()))
}

func TestTraceparentRoundTrip(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	require.Empty(t, tracing.Traceparent(context.Background()))

	ctx, parent := tp.Tracer("test").Start(context.Background(), "create")
	tpHeader := tracing.Traceparent(ctx)
	require.Regexp(t, `^00-[0-9a-f]{32}-[0-9a-f]{16}-01$`, tpHeader)
	parent.End()

	_, child := tp.Tracer("test").Start(tracing.WithTraceparent(context.Background(), tpHeader), "result")
	child.End()
	require.Equal(t, parent.SpanContext().TraceID(), child.SpanContext().TraceID())
	require.Equal(t, parent.SpanContext().SpanID(), rec.Ended()[1].Parent().SpanID())

	bad := tracing.WithTraceparent(context.Background(), "00-not-a-traceparent")
	require.False(t, trace.SpanContextFromContext(bad).IsValid())
}

// TestPgxTracerOnlyInsideATrace: queries of a traced call become its
// children; the background queries of a service (no span) record nothing,
// and never end a span they did not start.
func TestPgxTracerOnlyInsideATrace(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	pcfg, err := pgdb.PoolConfig(pgdb.Config{URL: db.URL, Tracer: tracing.PgxTracer(tp)})
	require.NoError(t, err)
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	require.NoError(t, err)
	defer pool.Close()

	var n int
	require.NoError(t, pool.QueryRow(context.Background(), "SELECT 1").Scan(&n))
	require.Empty(t, rec.Ended(), "no span without a parent")

	ctx, parent := tp.Tracer("test").Start(context.Background(), "call")
	require.NoError(t, pool.QueryRow(ctx, "SELECT length($1::text)", "arg-7f3c9e").Scan(&n))
	require.Len(t, rec.Ended(), 1, "the query's span")
	require.True(t, parent.IsRecording(), "the parent is still open")
	parent.End()
	q := rec.Ended()[0]
	require.Equal(t, parent.SpanContext().TraceID(), q.SpanContext().TraceID())
	require.Equal(t, parent.SpanContext().SpanID(), q.Parent().SpanID())
	for _, a := range q.Attributes() {
		require.NotContains(t, a.Value.String(), "arg-7f3c9e", "query arguments are never recorded (%s)", a.Key)
	}
}
