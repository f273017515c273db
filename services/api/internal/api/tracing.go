package api

import (
	"fmt"

	"connectrpc.com/otelconnect"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/pkg/tracing"
)

// newTraceInterceptor starts a server span for every ControlService call
// (outermost, so refused calls are traced too). A caller's traceparent is
// not trusted: the call starts a new trace linked to it, so an anonymous
// client can neither choose trace ids nor force sampling. Request metrics
// stay with Prometheus (metrics.go).
func newTraceInterceptor(tp trace.TracerProvider) (*otelconnect.Interceptor, error) {
	i, err := otelconnect.NewInterceptor(
		otelconnect.WithTracerProvider(tracing.TracerProvider(tp)),
		otelconnect.WithPropagator(propagation.TraceContext{}),
		otelconnect.WithoutMetrics(),
	)
	if err != nil {
		return nil, fmt.Errorf("tracing interceptor: %w", err)
	}
	return i, nil
}

// traceparentArg is the traceparent stored with a new command, NULL when
// the call is not traced.
func traceparentArg(tp string) *string {
	if tp == "" {
		return nil
	}
	return &tp
}
