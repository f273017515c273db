// Package tracing sets up OpenTelemetry tracing for a leasehold process from
// the standard OTEL_* environment, and carries a trace through the database
// as a W3C traceparent.
//
// Tracing is off unless the environment asks for it: OTEL_TRACES_EXPORTER
// set to an exporter other than "none", or an OTLP endpoint
// (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT).
// OTEL_SDK_DISABLED=true turns it off whatever else is set. Off, every
// tracer is a no-op and nothing is exported. On, OTEL_TRACES_EXPORTER
// chooses the exporter: otlp (the default), console (spans as JSON on
// stdout) or none. OTLP goes over OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else
// OTEL_EXPORTER_OTLP_PROTOCOL: http/protobuf (the default) or grpc. Any
// other value of these variables makes Setup fail with an error naming the
// variable. The exporters read the rest of OTEL_EXPORTER_OTLP_* themselves
// (endpoint, headers, TLS, compression, timeout). Only the trace exporters
// are linked: not contrib/exporters/autoexport, which brings the log and
// metric exporters along (docs/decisions.md). Sampling follows
// OTEL_TRACES_SAMPLER (parent-based always-on by default) and batching
// OTEL_BSP_*; the resource's service.name is "leasehold-<service>" unless
// OTEL_SERVICE_NAME says otherwise.
package tracing

import (
	"context"
	"fmt"
	"os"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Enabled reports whether the environment turns tracing on (see the package
// documentation).
func Enabled() bool {
	if envValue(envSDKDisabled) == "true" {
		return false
	}
	if v := envValue(envTracesExporter); v != "" {
		return v != exporterNone
	}
	return os.Getenv(envOTLPEndpoint) != "" || os.Getenv(envOTLPTracesEndpoint) != ""
}

// Provider is a process's tracer provider and how to stop it.
type Provider struct {
	trace.TracerProvider
	// Enabled is false for the no-op provider.
	Enabled  bool
	shutdown func(context.Context) error
}

// Shutdown flushes the spans not yet exported and stops the exporter; a
// no-op when tracing is off.
func (p *Provider) Shutdown(ctx context.Context) error {
	if p.shutdown == nil {
		return nil
	}
	return p.shutdown(ctx)
}

// Setup builds the process's tracer provider from the environment and
// installs it, with the W3C trace-context and baggage propagators, as the
// global one (which is what instrumentation libraries default to). Off, it
// returns a no-op provider and installs nothing.
func Setup(ctx context.Context, service, instanceID string) (*Provider, error) {
	if !Enabled() {
		return &Provider{TracerProvider: noop.NewTracerProvider()}, nil
	}
	exp, err := newSpanExporter(ctx)
	if err != nil {
		return nil, fmt.Errorf("tracing: span exporter from the OTEL_* environment: %w", err)
	}
	// Later options win: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
	// override the defaults.
	res, err := resource.New(ctx,
		resource.WithTelemetrySDK(),
		resource.WithAttributes(
			attribute.String("service.name", "leasehold-"+service),
			attribute.String("service.instance.id", instanceID),
		),
		resource.WithFromEnv(),
	)
	if err != nil {
		_ = exp.Shutdown(ctx)
		return nil, fmt.Errorf("tracing: resource: %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	return &Provider{TracerProvider: tp, Enabled: true, shutdown: tp.Shutdown}, nil
}
