package reload

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	reloads *prometheus.CounterVec // by result, curried with config
	failing prometheus.Gauge
}

var (
	reloadsDesc = prometheus.CounterOpts{
		Name: "leasehold_config_reloads_total",
		Help: "Reloads of configuration files (TLS certificates, CA bundles, API tokens) after they changed, by result.",
	}
	failingDesc = prometheus.GaugeOpts{
		Name: "leasehold_config_reload_failing",
		Help: "1 while the newest contents of a configuration's files failed to load and the previous ones stay in force.",
	}
	expiryDesc = prometheus.GaugeOpts{
		Name: "leasehold_tls_certificate_expiry_timestamp_seconds",
		Help: "NotAfter of the loaded TLS certificate (cert=serving) or of the earliest-expiring certificate of the client CA bundle (cert=client_ca), in Unix seconds.",
	}
)

// register registers c on reg, or returns the collector already registered
// under the same description (several components of one process, or tests,
// share a registry).
func register[C prometheus.Collector](reg prometheus.Registerer, c C) C {
	if reg == nil {
		return c
	}
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing
			}
		}
		panic(err)
	}
	return c
}

func newMetrics(reg prometheus.Registerer, config string) *metrics {
	reloads := register(reg, prometheus.NewCounterVec(reloadsDesc, []string{"config", "result"}))
	failing := register(reg, prometheus.NewGaugeVec(failingDesc, []string{"config"}))
	return &metrics{
		reloads: reloads.MustCurryWith(prometheus.Labels{"config": config}),
		failing: failing.WithLabelValues(config),
	}
}

func (m *metrics) set(ok bool) {
	if ok {
		m.failing.Set(0)
	} else {
		m.failing.Set(1)
	}
}

func newExpiry(reg prometheus.Registerer) *prometheus.GaugeVec {
	return register(reg, prometheus.NewGaugeVec(expiryDesc, []string{"component", "cert"}))
}
