package reconcile

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	runs          *prometheus.CounterVec
	runSeconds    *prometheus.HistogramVec
	fenceFailures *prometheus.CounterVec
	queueDepth    *prometheus.GaugeVec
	queueOverdue  *prometheus.GaugeVec
	periods       *prometheus.CounterVec
	sinkBatches   *prometheus.CounterVec
	selfReleases  prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		runs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_reconcile_runs_total", Help: "Reconcile runs by reconciler and outcome (ok, error, lease_lost)."},
			[]string{"reconciler", "outcome"}),
		runSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "leasehold_reconcile_duration_seconds", Help: "Duration of a reconcile's fenced transaction.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 14)}, []string{"reconciler"}),
		fenceFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_fence_failures_total", Help: "Fenced transactions refused because the lease was no longer held."},
			[]string{"lease_kind"}),
		queueDepth: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "leasehold_queue_depth", Help: "Keys in the work queue, by reconciler."}, []string{"reconciler"}),
		queueOverdue: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "leasehold_queue_overdue", Help: "Keys due more than 5 minutes ago, by reconciler."}, []string{"reconciler"}),
		periods: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_singleton_periods_total", Help: "Periods completed by periodic singletons."}, []string{"singleton"}),
		sinkBatches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_sink_batches_total", Help: "Batches delivered by sinks, by outcome."}, []string{"sink", "outcome"}),
		selfReleases: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_self_releases_total", Help: "Times a stalled loop made this process release every lease."}),
	}
	if reg != nil {
		reg.MustRegister(m.runs, m.runSeconds, m.fenceFailures, m.queueDepth, m.queueOverdue, m.periods, m.sinkBatches, m.selfReleases)
	}
	return m
}
