package gateway

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/pkg/daemon"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// TestDispatchAndResultJoinTheCommandsTrace: for a command stored with the
// traceparent of its CreateCommand call, the gateway's dispatch and result
// spans are children of that call's span; an untraced command gets none.
func TestDispatchAndResultJoinTheCommandsTrace(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	g, err := New(testConfig(), Deps{ID: fmt.Sprintf("gw_trace%d", gwSeq.Add(1)), DB: db.Pool, NotifyURL: db.DirectURL, Registry: prometheus.NewRegistry(), Tracer: tp})
	require.NoError(t, err)
	require.NoError(t, services.StartAndAwaitRunning(context.Background(), g))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = services.StopAndAwaitTerminated(ctx, g)
	})
	creds := registerNodes(t, db, "n", 1)

	// The api's CreateCommand span, as another process would have made it.
	_, call := tp.Tracer("api").Start(context.Background(), "CreateCommand")
	call.End()
	sc := call.SpanContext()
	traced := insertCommand(t, db, "n-0", "exec")
	_, err = db.Pool.Exec(context.Background(), `UPDATE commands SET traceparent = $2 WHERE id = $1`, traced,
		"00-"+sc.TraceID().String()+"-"+sc.SpanID().String()+"-01")
	require.NoError(t, err)
	untraced := insertCommand(t, db, "n-0", "exec")

	d, err := daemon.New(daemon.Config{Address: "http://" + g.Addr(), NodeID: "n-0", Credential: creds[0], Handler: noopHandler})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = d.Run(ctx) })
	defer func() { cancel(); wg.Wait() }()
	require.Eventually(t, func() bool {
		var n int
		_ = db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM commands WHERE id = ANY($1) AND state = 'succeeded'`, []string{traced, untraced}).Scan(&n)
		return n == 2
	}, 30*time.Second, 20*time.Millisecond, "both commands run to a result")

	// The result's span ends once its write returned, which can be a
	// moment after the row is visible: wait for both spans.
	byName := map[string][]sdktrace.ReadOnlySpan{}
	require.Eventually(t, func() bool {
		byName = map[string][]sdktrace.ReadOnlySpan{}
		for _, s := range rec.Ended() {
			byName[s.Name()] = append(byName[s.Name()], s)
		}
		return len(byName[spanDispatch]) >= 1 && len(byName[spanResult]) >= 1
	}, 10*time.Second, 10*time.Millisecond, "the dispatch and result spans end")
	for _, name := range []string{spanDispatch, spanResult} {
		require.Len(t, byName[name], 1, "%s: one span, for the traced command only", name)
		s := byName[name][0]
		require.Equal(t, sc.TraceID(), s.SpanContext().TraceID(), name)
		require.Equal(t, sc.SpanID(), s.Parent().SpanID(), "%s is a child of the CreateCommand span", name)
		require.Contains(t, s.Attributes(), attribute.String("leasehold.command.id", traced), name)
	}
	require.Equal(t, trace.SpanKindConsumer, byName[spanResult][0].SpanKind())
}
