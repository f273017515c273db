package gateway

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasehold/leasehold/pkg/health"
)

type metrics struct {
	streams         prometheus.Gauge
	sessions        prometheus.Gauge
	hellos          *prometheus.CounterVec
	pushbacks       *prometheus.CounterVec
	helloRefusals   *prometheus.CounterVec
	dispatched      prometheus.Counter
	replayed        prometheus.Counter
	dispatchLatency prometheus.Histogram
	dispatchCall    prometheus.Histogram
	windowFull      prometheus.Counter
	lag             prometheus.Gauge
	overloaded      prometheus.Gauge
	queueWait       prometheus.Gauge
	ingestRetries   prometheus.Counter
	clockSkew       prometheus.Gauge
	nodeSkewMax     prometheus.Gauge
	ingestBatch     prometheus.Histogram
	ingestFlush     prometheus.Histogram
	fenceFailures   prometheus.Counter
	selfFences      prometheus.Counter
	zombies         prometheus.Counter
	renewLatency    prometheus.Histogram
	results         *prometheus.CounterVec
	events          *prometheus.CounterVec
	specPushes      prometheus.Counter
	outputBytes     *prometheus.CounterVec
	cancels         *prometheus.CounterVec
	tunnelsOpen     prometheus.Gauge
	tunnelsOpened   prometheus.Counter
	tunnelsRefused  *prometheus.CounterVec
	tunnelsIdle     prometheus.Counter
	tunnelBytes     *prometheus.CounterVec
	outputRelayed   prometheus.Counter
	watchersLagged  prometheus.Counter
	role            *health.RoleGauge
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		streams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_gateway_streams", Help: "Open node streams, including those still in their Hello.",
		}),
		sessions: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_gateway_sessions", Help: "Node sessions held by this gateway.",
		}),
		hellos: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_gateway_hellos_total", Help: "Hellos by outcome (welcomed, pushback, unauthenticated, refused, error, abandoned: the node went away before its Welcome); rate() gives the Hello rate.",
		}, []string{"outcome"}),
		pushbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_gateway_pushbacks_total", Help: "Dials refused with a retry-after pushback, by limit.",
		}, []string{"reason"}),
		helloRefusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_gateway_hello_refusals_total", Help: "Hellos refused for good, by reason (no-hello, invalid, cert-node, credential-malformed, unauthenticated, registration); pushbacks are counted apart.",
		}, []string{"reason"}),
		dispatched: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_gateway_commands_dispatched_total", Help: "Pending commands dispatched to nodes.",
		}),
		replayed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_gateway_commands_replayed_total", Help: "In-flight commands replayed after a Hello.",
		}),
		dispatchLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "leasehold_gateway_dispatch_latency_seconds", Help: "Command insert to dispatch, on the database clock.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}),
		dispatchCall: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "leasehold_gateway_dispatch_call_seconds", Help: "Duration of one fenced dispatch transaction (fence, pick, update, commit).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}),
		ingestRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_gateway_ingest_conflict_retries_total", Help: "Group commits written again whole after the database aborted them for a lock conflict (a deadlock with a Hello's replay, a serialization failure).",
		}),
		clockSkew: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_clock_skew_seconds", Help: "Process clock minus compute_now(), from the last session liveness write.",
		}),
		nodeSkewMax: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_gateway_node_clock_skew_max_seconds", Help: "Largest absolute clock skew (node clock minus database clock, from heartbeats) among this gateway's sessions at the last liveness write.",
		}),
		lag: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_gateway_lag_seconds", Help: "Last second's mean wait for dispatch of commands whose node had room, plus the oldest result's wait for the group commit (--gateway.overload-lag).",
		}),
		queueWait: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_gateway_queue_wait_seconds", Help: "While overloaded and for a while after: the commands pending for nodes whose window the gateway has to free, over the results it read in the last second (0 otherwise).",
		}),
		overloaded: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_gateway_overloaded", Help: "1 while this gateway reports overload (the api refuses new commands for its nodes), else 0.",
		}),
		windowFull: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_gateway_node_window_full_total", Help: "Dispatch rounds that skipped a session because its node window (--gateway.node-window) was full.",
		}),
		ingestBatch: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "leasehold_gateway_ingest_batch_size", Help: "Results, acks and events written per group-commit transaction.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 12),
		}),
		ingestFlush: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "leasehold_gateway_ingest_flush_seconds", Help: "Duration of one group-commit transaction of results, acks and events.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}),
		fenceFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_gateway_fence_failures_total", Help: "Fenced transactions refused because the gateway lease was no longer held.",
		}),
		selfFences: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_gateway_self_fences_total", Help: "Times this gateway fenced itself.",
		}),
		zombies: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_gateway_zombie_sessions_total", Help: "Sessions closed because the node said Hello elsewhere.",
		}),
		renewLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "leasehold_gateway_lease_renew_seconds", Help: "Latency of gateway lease renewals.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}),
		results: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_gateway_command_results_total", Help: "Command results received, by outcome (stored, duplicate, ignored: a command's second result under another id, unknown, denied, refused: the database refused it for good and its command was failed).",
		}, []string{"outcome"}),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_gateway_node_events_total", Help: "Node events received, by outcome (stored, duplicate, refused).",
		}, []string{"outcome"}),
		specPushes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_gateway_spec_updates_total", Help: "NodeSpecUpdate messages pushed to nodes.",
		}),
		outputBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_gateway_command_output_bytes_total", Help: "Bytes of live command output received, by outcome (stored, dropped: past the cap or refused).",
		}, []string{"outcome"}),
		cancels: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_gateway_command_cancels_total", Help: "CancelCommand messages sent to nodes (sent) and CancelAcks received (confirmed).",
		}, []string{"outcome"}),
		tunnelsOpen: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "leasehold_gateway_tunnels_open", Help: "Tunnels relayed by this gateway now (waiting for the node to attach, or open).",
		}),
		tunnelsOpened: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_gateway_tunnels_opened_total", Help: "Tunnels opened end to end.",
		}),
		tunnelsRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_gateway_tunnels_refused_total", Help: "Tunnels refused, by reason (max-tunnels-per-node, max-tunnels, no-session, attach-timeout, node).",
		}, []string{"reason"}),
		tunnelsIdle: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_gateway_tunnels_idle_closed_total", Help: "Tunnels ended by --gateway.tunnel-idle-timeout.",
		}),
		tunnelBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "leasehold_gateway_tunnel_bytes_total", Help: "Tunnel bytes relayed, by direction (to_node, from_node).",
		}, []string{"direction"}),
		outputRelayed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_gateway_output_relayed_bytes_total", Help: "Live output past --gateway.output-cap relayed to WatchOutput callers (the api's live readers).",
		}),
		watchersLagged: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "leasehold_gateway_output_watchers_lagged_total", Help: "WatchOutput calls ended because their reader fell behind the node for longer than the stall bound.",
		}),
	}
	reg.MustRegister(m.streams, m.sessions, m.hellos, m.pushbacks, m.dispatched, m.replayed, m.dispatchLatency, m.dispatchCall, m.windowFull, m.ingestBatch, m.ingestFlush,
		m.fenceFailures, m.selfFences, m.zombies, m.renewLatency, m.results, m.events, m.specPushes)
	reg.MustRegister(m.outputBytes, m.cancels, m.helloRefusals, m.clockSkew, m.nodeSkewMax, m.ingestRetries, m.lag, m.overloaded, m.queueWait)
	reg.MustRegister(m.tunnelsOpen, m.tunnelsOpened, m.tunnelsRefused, m.tunnelsIdle, m.tunnelBytes, m.outputRelayed, m.watchersLagged)
	m.role = health.NewRoleGauge(reg, "gateway")
	return m
}
