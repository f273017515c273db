// Package collector is the metrics:command-latency singleton: the one
// process that observes command latency (created to finished) and exports
// the fleet gauges (nodes by state, commands by state, overdue work). Only
// the lease holder exports them, so a fleet-wide sum never double counts;
// a process that loses the lease clears its copies.
package collector

import (
	"context"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasehold/leasehold/pkg/pgdb"
	"github.com/leasehold/leasehold/pkg/queue"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

// LeaseName is the collector's lease.
const LeaseName = "metrics:command-latency"

// Collector holds the exported series.
type Collector struct {
	every    time.Duration
	nodes    *prometheus.GaugeVec
	commands *prometheus.GaugeVec
	overdue  *prometheus.GaugeVec
	latency  *prometheus.HistogramVec
}

// New registers the collector's series on reg.
func New(reg prometheus.Registerer, every time.Duration) *Collector {
	c := &Collector{
		every: every,
		nodes: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "leasehold_fleet_nodes", Help: "Nodes by state (exported by the metrics:command-latency holder only)."}, []string{"state"}),
		commands: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "leasehold_fleet_commands", Help: "Commands not finished yet, by state: pending, dispatched, acknowledged (exported by the metrics:command-latency holder only; finished ones are counted by leasehold_command_latency_seconds_count)."}, []string{"state"}),
		overdue: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "leasehold_fleet_overdue_work", Help: "Work-queue keys due more than 5 minutes ago, by reconciler."}, []string{"reconciler"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "leasehold_command_latency_seconds", Help: "Command latency from creation to result, observed once per command by the metrics:command-latency holder.",
			Buckets: prometheus.ExponentialBuckets(0.005, 2, 16)}, []string{"kind", "state"}),
	}
	if reg != nil {
		reg.MustRegister(c.nodes, c.commands, c.overdue, c.latency)
	}
	return c
}

// Register adds the collector job to rt.
func (c *Collector) Register(rt *reconcile.Runtime) error {
	return rt.RegisterJob(reconcile.Job{Name: "command-latency", Lease: LeaseName, Run: c.run})
}

func (c *Collector) run(ctx context.Context, jc *reconcile.JobContext) error {
	defer c.clear()
	var watermark time.Time
	if err := jc.DB().QueryRow(ctx, "SELECT compute_now()").Scan(&watermark); err != nil {
		return fmt.Errorf("collector start: %w", err)
	}
	for {
		if _, err := jc.Current(); err != nil {
			return err
		}
		next, err := c.collect(ctx, jc.DB(), watermark)
		if err == nil {
			watermark = next
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(c.every):
		}
	}
}

func (c *Collector) clear() {
	c.nodes.Reset()
	c.commands.Reset()
	c.overdue.Reset()
}

// collect refreshes the gauges and observes the latency of commands that
// finished after watermark; it returns the new watermark.
func (c *Collector) collect(ctx context.Context, db pgdb.Querier, watermark time.Time) (time.Time, error) {
	if err := c.gauge(ctx, db, c.nodes, "SELECT state, count(*) FROM nodes GROUP BY state"); err != nil {
		return watermark, err
	}
	if err := c.gauge(ctx, db, c.commands, activeCommandsSQL); err != nil {
		return watermark, err
	}
	stats, err := queue.Depth(ctx, db)
	if err != nil {
		return watermark, err
	}
	c.overdue.Reset()
	for name, st := range stats {
		c.overdue.WithLabelValues(name).Set(float64(st.Overdue))
	}
	rows, err := db.Query(ctx, finishedSinceSQL, watermark)
	if err != nil {
		return watermark, fmt.Errorf("read finished commands: %w", err)
	}
	defer rows.Close()
	next := watermark
	for rows.Next() {
		var kind, state string
		var secs float64
		var at time.Time
		if err := rows.Scan(&kind, &state, &secs, &at); err != nil {
			return watermark, err
		}
		c.latency.WithLabelValues(kind, state).Observe(secs)
		next = at
	}
	return next, rows.Err()
}

// activeCommandsSQL counts the commands not finished yet, by state, each
// arm from its partial index (commands_pending_idx, commands_in_flight_idx):
// the pass costs the live work, not the retained history. Finished
// commands are counted by the latency histogram's _count instead.
const activeCommandsSQL = `
SELECT 'pending', count(*) FROM commands WHERE state = 'pending'
UNION ALL
SELECT command_state(state, acked_at), count(*) FROM commands WHERE state IN ('dispatched', 'acknowledged') GROUP BY 1`

// finishedSinceSQL reads the commands finished after the watermark from
// commands_finished_idx (migration 00025), so a pass reads what finished
// since the last one.
const finishedSinceSQL = `
SELECT kind, state, extract(epoch FROM finished_at - created_at)::float8, finished_at
  FROM commands
 WHERE finished_at > $1 AND finished_at IS NOT NULL AND state IN ('succeeded', 'failed')
 ORDER BY finished_at
 LIMIT 100000`

func (c *Collector) gauge(ctx context.Context, db pgdb.Querier, g *prometheus.GaugeVec, sql string) error {
	rows, err := db.Query(ctx, sql)
	if err != nil {
		return fmt.Errorf("collect: %w", err)
	}
	defer rows.Close()
	g.Reset()
	for rows.Next() {
		var label string
		var n int64
		if err := rows.Scan(&label, &n); err != nil {
			return err
		}
		g.WithLabelValues(label).Set(float64(n))
	}
	return rows.Err()
}
