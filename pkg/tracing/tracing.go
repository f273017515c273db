// Package tracing sets up OpenTelemetry tracing for a leasehold process from
// the standard OTEL_* environment, and carries a trace through the database
// as a W3C traceparent.
//
// Tracing is off unless the environment asks for it: OTEL_TRACES_EXPORTER
// set to an exporter other than "none", or an OTLP endpoint
// (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT).
// OTEL_SDK_DISABLED=true turns it off whatever else is set. Off, every
// tracer is a no-op and nothing is exported. On, the exporter is chosen by
// go.opentelemetry.io/contrib/exporters/autoexport (otlp by default,
// console, none), sampling by OTEL_TRACES_SAMPLER (parent-based always-on by
// default) and batching by OTEL_BSP_*; the resource's service.name is
// "leasehold-<service>" unless OTEL_SERVICE_NAME says otherwise.
package tracing

import (
	"context"
	"fmt"
	"os"
	"strings"

	"go.opentelemetry.io/contrib/exporters/autoexport"
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
	if strings.EqualFold(strings.TrimSpace(os.Getenv("OTEL_SDK_DISABLED")), "true") {
		return false
	}
	if v := strings.TrimSpace(os.Getenv("OTEL_TRACES_EXPORTER")); v != "" {
		return v != "none"
	}
	return os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
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
	exp, err := autoexport.NewSpanExporter(ctx)
	if err != nil {
		return nil, fmt.Errorf("tracing: span exporter from OTEL_* environment: %w", err)
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
