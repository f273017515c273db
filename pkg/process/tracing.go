package process

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel"

	"github.com/leasehold/leasehold/pkg/tracing"
)

// setupTracing turns OpenTelemetry tracing on when the OTEL_* environment
// asks for it (package tracing) and returns the provider, the pool's query
// tracer (nil when off) and the shutdown that flushes spans on exit.
func setupTracing(ctx context.Context, service, id string, logger *slog.Logger) (*tracing.Provider, pgx.QueryTracer, func(), error) {
	tp, err := tracing.Setup(ctx, service, id)
	if err != nil {
		return nil, nil, nil, err
	}
	if !tp.Enabled {
		return tp, nil, func() {}, nil
	}
	logger.Info("OpenTelemetry tracing on (OTEL_* environment)")
	// Export failures (a collector down) go to the process's log, not to
	// the SDK's default stderr logger.
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) { logger.Warn("OpenTelemetry", "err", err) }))
	shutdown := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := tp.Shutdown(ctx); err != nil {
			logger.Warn("flush traces on exit", "err", err)
		}
	}
	return tp, tracing.PgxTracer(tp), shutdown, nil
}
