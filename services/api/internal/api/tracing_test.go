package api

import (
	"context"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1/controlv1connect"
)

// TestCreateCommandStoresTraceparent: a traced CreateCommand stores the W3C
// traceparent of its server span with the command, for the gateway's
// dispatch and result spans; an untraced one stores NULL.
func TestCreateCommandStoresTraceparent(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	b := setupWith(t, func(d *Deps) { d.Tracer = tp })
	untraced := setup(t)
	ctx := ctxT(t)
	b.registerNode("node-1", nil)
	untraced.registerNode("node-1", nil)

	resp, err := b.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
	require.NoError(t, err)
	var server trace.SpanContext
	for _, s := range rec.Ended() {
		if s.Name() == controlv1connect.ControlServiceCreateCommandProcedure[1:] && s.SpanKind() == trace.SpanKindServer {
			server = s.SpanContext()
		}
	}
	require.True(t, server.IsValid(), "a server span for CreateCommand")
	var stored *string
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), `SELECT traceparent FROM commands WHERE id = $1`, resp.Msg.GetCommand().GetId()).Scan(&stored))
	require.NotNil(t, stored)
	require.Equal(t, "00-"+server.TraceID().String()+"-"+server.SpanID().String()+"-01", *stored)

	resp, err = untraced.operator.CreateCommand(ctx, connect.NewRequest(&controlv1.CreateCommandRequest{NodeId: "node-1", Kind: "exec", Payload: []byte(`{"argv":["true"]}`)}))
	require.NoError(t, err)
	require.NoError(t, untraced.db.Pool.QueryRow(context.Background(), `SELECT traceparent FROM commands WHERE id = $1`, resp.Msg.GetCommand().GetId()).Scan(&stored))
	require.Nil(t, stored, "tracing off: nothing stored")
}
