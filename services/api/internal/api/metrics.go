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
// outside the auth interceptor.
func (m *metrics) interceptor() connect.UnaryInterceptorFunc {
	return func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if req.Spec().IsClient {
				return next(ctx, req)
			}
			start := time.Now()
			m.inFlight.Inc()
			resp, err := next(ctx, req)
			m.inFlight.Dec()
			code := "ok"
			if err != nil {
				code = connect.CodeOf(err).String()
			}
			proc := req.Spec().Procedure
			m.requests.WithLabelValues(proc, code).Inc()
			m.duration.WithLabelValues(proc).Observe(time.Since(start).Seconds())
			return resp, err
		}
	}
}
