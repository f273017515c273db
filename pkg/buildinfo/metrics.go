package buildinfo

import "github.com/prometheus/client_golang/prometheus"

// MetricName is the build gauge's name.
const MetricName = "leasehold_build_info"

// NewCollector returns the gauge leasehold_build_info{version,revision,
// goversion}, always 1, for a process's registry: join it on other series
// to label them with the build (`* on(instance) group_left(version)`).
func NewCollector() prometheus.Collector {
	i := Get()
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: MetricName,
		Help: "A constant 1 labelled with the running build's version, VCS revision and Go version.",
		ConstLabels: prometheus.Labels{
			"version": i.Version, "revision": i.Revision, "goversion": i.GoVersion,
		},
	}, func() float64 { return 1 })
}
