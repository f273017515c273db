package coord

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	leasesHeld   prometheus.Gauge
	shardsOwned  *prometheus.GaugeVec
	epochs       *prometheus.GaugeVec
	renewSeconds prometheus.Histogram
	renewFails   prometheus.Counter
	leasesLost   prometheus.Counter
	clockSkew    prometheus.Gauge
	passes       *prometheus.CounterVec
	liveMembers  *prometheus.GaugeVec

	livenessUp        prometheus.Gauge
	livenessTakeovers prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		leasesHeld: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_leases_held", Help: "Leases this process holds (shards and singletons)."}),
		shardsOwned: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "leasehold_shards_owned", Help: "Shard leases this process holds, by membership group."}, []string{"group"}),
		epochs: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "leasehold_lease_epoch", Help: "Epoch of each singleton lease this process holds (0 when not held)."}, []string{"lease"}),
		renewSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "leasehold_lease_renew_duration_seconds", Help: "Duration of the acquire/renew statement of a membership pass.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14)}),
		renewFails: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_lease_renew_failures_total", Help: "Membership passes that failed (database errors)."}),
		leasesLost: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_leases_lost_total", Help: "Leases this process held that a renewal did not return."}),
		clockSkew: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_clock_skew_seconds", Help: "Process clock minus compute_now(), from the last renewal."}),
		passes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_membership_passes_total", Help: "Membership passes by trigger."}, []string{"trigger"}),
		liveMembers: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "leasehold_live_members", Help: "Live members of each group at the last pass."}, []string{"group"}),
		livenessUp: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_liveness_session_up", Help: "1 while this process's liveness session holds its lock and answered its last ping; 0 otherwise or with liveness off."}),
		livenessTakeovers: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_liveness_takeovers_total", Help: "Dead members whose leases this process released after their liveness session ended."}),
	}
	if reg != nil {
		reg.MustRegister(m.leasesHeld, m.shardsOwned, m.epochs, m.renewSeconds, m.renewFails, m.leasesLost, m.clockSkew, m.passes, m.liveMembers, m.livenessUp, m.livenessTakeovers)
	}
	return m
}
