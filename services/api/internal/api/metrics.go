package api

import (
	"context"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec
	inFlight prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer, w *waiter) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_api_requests_total",
			Help: "ControlService calls by procedure and Connect code (ok on success).",
		}, []string{"procedure", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "leasehold_api_request_duration_seconds",
			Help:    "ControlService call latency by procedure.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"procedure"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_api_requests_in_flight",
			Help: "ControlService calls being served.",
		}),
	}
	waiting := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "leasehold_api_wait_commands",
		Help: "Commands that WaitCommand calls are waiting for.",
	}, func() float64 { return float64(w.len()) })
	reg.MustRegister(m.requests, m.duration, m.inFlight, waiting)
	return m
}

// interceptor counts every call, refused ones included, so it runs
// outside the auth interceptor. A streaming call (StreamCommandOutput) is
// counted when it ends, its duration being the stream's.
func (m *metrics) interceptor() connect.Interceptor { return metricsInterceptor{m} }

type metricsInterceptor struct{ m *metrics }

func (mi metricsInterceptor) observe(proc string, start time.Time, err error) {
	code := "ok"
	if err != nil {
		code = connect.CodeOf(err).String()
	}
	mi.m.requests.WithLabelValues(proc, code).Inc()
	mi.m.duration.WithLabelValues(proc).Observe(time.Since(start).Seconds())
}

func (mi metricsInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			return next(ctx, req)
		}
		start := time.Now()
		mi.m.inFlight.Inc()
		resp, err := next(ctx, req)
		mi.m.inFlight.Dec()
		mi.observe(req.Spec().Procedure, start, err)
		return resp, err
	}
}

func (mi metricsInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (mi metricsInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		start := time.Now()
		mi.m.inFlight.Inc()
		err := next(ctx, conn)
		mi.m.inFlight.Dec()
		mi.observe(conn.Spec().Procedure, start, err)
		return err
	}
}
