// Package janitor is a periodic singleton that deletes what has aged out:
// workers rows silent for long, finished commands and their results, and
// node events past retention that every sink has delivered, audit events
// past the audit retention, and runs finished longer ago than the command
// retention (with their nodes). Each table is
// trimmed in bounded batches so one run never holds a long transaction.
package janitor

import (
	"context"
	"flag"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasehold/leasehold/pkg/reconcile"
)

// Config holds the retentions.
type Config struct {
	// Every is the janitor's period (1 min).
	Every time.Duration
	// WorkersAfter deletes workers rows silent this long (10 min).
	WorkersAfter time.Duration
	// CommandRetention keeps finished commands and results this long (7 d).
	CommandRetention time.Duration
	// EventRetention keeps node events this long (7 d) — longer when a sink
	// has not delivered them yet.
	EventRetention time.Duration
	// AuditRetention keeps audit_events rows this long (90 d).
	AuditRetention time.Duration
	// OutputRetention keeps the live output (command_output) of finished
	// commands this long (1 d); the command itself stays for
	// CommandRetention.
	OutputRetention time.Duration
	// Batch bounds the rows deleted per table per run.
	Batch int
}

// DefaultConfig is the default.
func DefaultConfig() Config {
	return Config{Every: time.Minute, WorkersAfter: 10 * time.Minute, CommandRetention: 7 * 24 * time.Hour,
		EventRetention: 7 * 24 * time.Hour, AuditRetention: 90 * 24 * time.Hour, OutputRetention: 24 * time.Hour, Batch: 5000}
}

// RegisterFlags registers the flags under prefix.
func (c *Config) RegisterFlags(prefix string, f *flag.FlagSet) {
	f.DurationVar(&c.Every, prefix+"interval", c.Every, "janitor period")
	f.DurationVar(&c.WorkersAfter, prefix+"workers-after", c.WorkersAfter, "delete workers rows silent this long")
	f.DurationVar(&c.CommandRetention, prefix+"command-retention", c.CommandRetention, "keep finished commands and their results, and finished runs, this long")
	f.DurationVar(&c.EventRetention, prefix+"event-retention", c.EventRetention, "keep node events this long (undelivered ones are kept)")
	f.DurationVar(&c.AuditRetention, prefix+"audit-retention", c.AuditRetention, "keep audit events this long")
	f.DurationVar(&c.OutputRetention, prefix+"output-retention", c.OutputRetention, "keep the live output of finished commands this long")
	f.IntVar(&c.Batch, prefix+"batch", c.Batch, "rows deleted per table per run")
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.Every < time.Second || c.WorkersAfter < time.Minute || c.CommandRetention < time.Minute || c.EventRetention < time.Minute || c.Batch < 1 {
		return fmt.Errorf("janitor: interval %s >= 1s, workers-after %s, command-retention %s and event-retention %s >= 1m, batch %d >= 1",
			c.Every, c.WorkersAfter, c.CommandRetention, c.EventRetention, c.Batch)
	}
	if c.AuditRetention < time.Hour {
		return fmt.Errorf("janitor: audit-retention %s must be >= 1h", c.AuditRetention)
	}
	if c.OutputRetention < time.Minute {
		return fmt.Errorf("janitor: output-retention %s must be >= 1m", c.OutputRetention)
	}
	return nil
}

// Counts is what one run deleted.
type Counts struct{ Workers, Commands, Events, Audit, Output, Runs int64 }

// Run trims every table once in tx.
func Run(ctx context.Context, tx pgx.Tx, cfg Config) (Counts, error) {
	var c Counts
	tag, err := tx.Exec(ctx, `DELETE FROM workers WHERE heartbeat_at < compute_now() - make_interval(secs => $1::float8)`, cfg.WorkersAfter.Seconds())
	if err != nil {
		return c, fmt.Errorf("delete silent workers: %w", err)
	}
	c.Workers = tag.RowsAffected()
	// Results go with their commands (ON DELETE CASCADE).
	tag, err = tx.Exec(ctx, `
DELETE FROM commands WHERE id IN (
  SELECT id FROM commands
   WHERE state IN ('succeeded', 'failed', 'cancelled', 'expired')
     AND finished_at < compute_now() - make_interval(secs => $1::float8)
   LIMIT $2)`, cfg.CommandRetention.Seconds(), cfg.Batch)
	if err != nil {
		return c, fmt.Errorf("delete old commands: %w", err)
	}
	c.Commands = tag.RowsAffected()
	// An event older than retention goes only once every sink is past it.
	tag, err = tx.Exec(ctx, `
DELETE FROM node_events WHERE (node_id, id) IN (
  SELECT e.node_id, e.id FROM node_events e
   WHERE e.received_at < compute_now() - make_interval(secs => $1::float8)
     AND NOT EXISTS (
       SELECT 1 FROM sinks k LEFT JOIN sink_cursors c ON c.sink_id = k.id
        WHERE c.sink_id IS NULL OR (e.txid::text::bigint, e.seq) > (c.cursor_txid, c.cursor))
   LIMIT $2)`, cfg.EventRetention.Seconds(), cfg.Batch)
	if err != nil {
		return c, fmt.Errorf("delete old events: %w", err)
	}
	c.Events = tag.RowsAffected()
	// The oldest audit events first, through the index on at.
	tag, err = tx.Exec(ctx, `
DELETE FROM audit_events WHERE id IN (
  SELECT id FROM audit_events
   WHERE at < compute_now() - make_interval(secs => $1::float8)
   ORDER BY at
   LIMIT $2)`, cfg.AuditRetention.Seconds(), cfg.Batch)
	if err != nil {
		return c, fmt.Errorf("delete old audit events: %w", err)
	}
	c.Audit = tag.RowsAffected()
	// Live output goes before its command: pieces of commands finished
	// longer ago than the output retention.
	tag, err = tx.Exec(ctx, `
DELETE FROM command_output WHERE (command_id, "offset") IN (
  SELECT o.command_id, o."offset" FROM commands c JOIN command_output o ON o.command_id = c.id
   WHERE c.state IN ('succeeded', 'failed', 'cancelled', 'expired')
     AND c.finished_at < compute_now() - make_interval(secs => $1::float8)
   LIMIT $2)`, cfg.OutputRetention.Seconds(), cfg.Batch)
	if err != nil {
		return c, fmt.Errorf("delete old command output: %w", err)
	}
	c.Output = tag.RowsAffected()
	// Runs live as long as commands; their run_nodes go with them (ON
	// DELETE CASCADE). A running run has no finished_at and stays.
	tag, err = tx.Exec(ctx, `
DELETE FROM runs WHERE id IN (
  SELECT id FROM runs
   WHERE finished_at < compute_now() - make_interval(secs => $1::float8)
   LIMIT $2)`, cfg.CommandRetention.Seconds(), cfg.Batch)
	if err != nil {
		return c, fmt.Errorf("delete old runs: %w", err)
	}
	c.Runs = tag.RowsAffected()
	return c, nil
}

// Register adds the janitor to rt as the periodic singleton "janitor".
func Register(rt *reconcile.Runtime, cfg Config, reg prometheus.Registerer) error {
	deleted := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "leasehold_janitor_deleted_total", Help: "Rows the janitor deleted, by table."}, []string{"table"})
	if reg != nil {
		reg.MustRegister(deleted)
	}
	return rt.RegisterPeriodic("janitor", cfg.Every, func(ctx context.Context, tx pgx.Tx, _ int64) error {
		c, err := Run(ctx, tx, cfg)
		deleted.WithLabelValues("workers").Add(float64(c.Workers))
		deleted.WithLabelValues("commands").Add(float64(c.Commands))
		deleted.WithLabelValues("node_events").Add(float64(c.Events))
		deleted.WithLabelValues("audit_events").Add(float64(c.Audit))
		deleted.WithLabelValues("command_output").Add(float64(c.Output))
		deleted.WithLabelValues("runs").Add(float64(c.Runs))
		return err
	})
}
