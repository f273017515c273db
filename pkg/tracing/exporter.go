package tracing

import (
	"context"
	"fmt"
	"os"
	"strings"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// The variables that choose the span exporter. Everything else the
// exporters read themselves (endpoints, headers, TLS files, compression,
// timeouts: OTEL_EXPORTER_OTLP_*).
const (
	envSDKDisabled        = "OTEL_SDK_DISABLED"
	envTracesExporter     = "OTEL_TRACES_EXPORTER"
	envOTLPEndpoint       = "OTEL_EXPORTER_OTLP_ENDPOINT"
	envOTLPTracesEndpoint = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
	envOTLPProtocol       = "OTEL_EXPORTER_OTLP_PROTOCOL"
	envOTLPTracesProtocol = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"

	exporterOTLP    = "otlp"
	exporterConsole = "console"
	exporterNone    = "none"

	protocolHTTPProtobuf = "http/protobuf"
	protocolGRPC         = "grpc"
)

// envValue is an enumerated OTEL_* value as the specification wants it
// read: surrounding space ignored, case-insensitive.
func envValue(key string) string {
	return strings.ToLower(strings.TrimSpace(os.Getenv(key)))
}

// newSpanExporter is the exporter OTEL_TRACES_EXPORTER names (otlp when
// unset); an unsupported value is an error naming the variable.
func newSpanExporter(ctx context.Context) (sdktrace.SpanExporter, error) {
	switch v := envValue(envTracesExporter); v {
	case "", exporterOTLP:
		return newOTLPExporter(ctx)
	case exporterConsole:
		return stdouttrace.New()
	default:
		// "none" never gets here: Enabled is false for it.
		return nil, fmt.Errorf("%s=%q is not supported: leasehold exports spans with %s, %s or %s",
			envTracesExporter, os.Getenv(envTracesExporter), exporterOTLP, exporterConsole, exporterNone)
	}
}

// newOTLPExporter is the OTLP exporter for the protocol of
// OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL,
// else http/protobuf.
func newOTLPExporter(ctx context.Context) (sdktrace.SpanExporter, error) {
	key := envOTLPTracesProtocol
	if envValue(key) == "" {
		key = envOTLPProtocol
	}
	switch envValue(key) {
	case "", protocolHTTPProtobuf:
		return otlptracehttp.New(ctx)
	case protocolGRPC:
		return otlptracegrpc.New(ctx)
	default:
		return nil, fmt.Errorf("%s=%q is not supported: leasehold exports OTLP spans over %s or %s",
			key, os.Getenv(key), protocolHTTPProtobuf, protocolGRPC)
	}
}
