// Package sweeper is the command sweeper, a periodic singleton: it expires
// commands past their deadline and puts dispatched-but-unacknowledged ones
// back to pending after AckTimeout, so a gateway dispatches them again (the
// daemon's journal makes the second delivery harmless).
package sweeper

import (
	"context"
	"flag"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasehold/leasehold/pkg/reconcile"
)

// Config holds the sweeper's timings.
type Config struct {
	// Every is the sweep period (5 s).
	Every time.Duration
	// AckTimeout re-queues a dispatched command not acknowledged this long.
	AckTimeout time.Duration
}

// DefaultConfig is the default.
func DefaultConfig() Config { return Config{Every: 5 * time.Second, AckTimeout: 30 * time.Second} }

// RegisterFlags registers the flags under prefix.
func (c *Config) RegisterFlags(prefix string, f *flag.FlagSet) {
	f.DurationVar(&c.Every, prefix+"interval", c.Every, "command sweep period")
	f.DurationVar(&c.AckTimeout, prefix+"ack-timeout", c.AckTimeout, "re-queue dispatched commands not acknowledged this long")
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.Every < 10*time.Millisecond || c.AckTimeout < time.Second {
		return fmt.Errorf("sweeper: interval %s must be >= 10ms and ack-timeout %s >= 1s", c.Every, c.AckTimeout)
	}
	return nil
}

// expireSQL expires the unfinished commands past their deadline, read from
// commands_deadline_idx (migration 00025): a pass costs the commands that
// have deadlines and are not finished, not the whole table.
const expireSQL = `
UPDATE commands SET state = 'expired', finished_at = compute_now()
 WHERE deadline IS NOT NULL AND state IN ('pending', 'dispatched', 'acknowledged') AND deadline < compute_now()`

// requeueSQL puts back the dispatched commands not acknowledged in time
// (an ack is acked_at, or the state 'acknowledged' a gateway of the
// previous release writes), read from commands_in_flight_idx: a pass costs
// the commands in flight.
const requeueSQL = `
UPDATE commands SET state = 'pending'
 WHERE state = 'dispatched' AND acked_at IS NULL AND dispatched_at < compute_now() - make_interval(secs => $1::float8)`

// Sweep runs one sweep in tx and returns how many commands it expired and
// re-queued.
func Sweep(ctx context.Context, tx pgx.Tx, cfg Config) (expired, requeued int64, err error) {
	tag, err := tx.Exec(ctx, expireSQL)
	if err != nil {
		return 0, 0, fmt.Errorf("expire commands: %w", err)
	}
	expired = tag.RowsAffected()
	tag, err = tx.Exec(ctx, requeueSQL, cfg.AckTimeout.Seconds())
	if err != nil {
		return expired, 0, fmt.Errorf("re-queue unacknowledged commands: %w", err)
	}
	return expired, tag.RowsAffected(), nil
}

// Register adds the sweeper to rt as the periodic singleton "sweeper".
func Register(rt *reconcile.Runtime, cfg Config, reg prometheus.Registerer) error {
	swept := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "leasehold_sweeper_commands_total", Help: "Commands the sweeper expired or re-queued."}, []string{"action"})
	if reg != nil {
		reg.MustRegister(swept)
	}
	return rt.RegisterPeriodic("sweeper", cfg.Every, func(ctx context.Context, tx pgx.Tx, _ int64) error {
		e, r, err := Sweep(ctx, tx, cfg)
		swept.WithLabelValues("expired").Add(float64(e))
		swept.WithLabelValues("requeued").Add(float64(r))
		return err
	})
}
