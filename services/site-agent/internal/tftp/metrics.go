package tftp

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	requests  *prometheus.CounterVec
	transfers *prometheus.CounterVec
	bytes     prometheus.Counter
	inflight  prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "leasehold_site_tftp_requests_total",
			Help: "TFTP requests by outcome: accepted, standby (not active: dropped), refused (write, bad mode, bad or missing file), busy, malformed."},
			[]string{"outcome"}),
		transfers: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "leasehold_site_tftp_transfers_total",
			Help: "TFTP transfers by outcome: completed, aborted (by the client, e.g. after a tsize query), timeout, fenced, error."},
			[]string{"outcome"}),
		bytes: prometheus.NewCounter(prometheus.CounterOpts{Name: "leasehold_site_tftp_sent_bytes_total",
			Help: "File bytes acknowledged by TFTP clients."}),
		inflight: prometheus.NewGauge(prometheus.GaugeOpts{Name: "leasehold_site_tftp_transfers_in_flight",
			Help: "TFTP transfers running now."}),
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.transfers, m.bytes, m.inflight)
	}
	return m
}
