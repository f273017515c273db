package reconcile

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/coord"
)

// PeriodicFunc does the work of one period inside the transaction fenced on
// the job's lease; period is floor(compute_now() / every) for the period
// being run.
type PeriodicFunc func(ctx context.Context, tx pgx.Tx, period int64) error

// RegisterPeriodic adds a periodic singleton: while this process holds
// singleton:<name>, fn runs once for every period of length every, and the
// period is recorded in singleton_periods in the same fenced transaction. A
// new holder continues at the period after the last one recorded, so a
// takeover neither skips nor repeats a period; periods missed while no one
// held the lease are run in order, one transaction each. The first holder
// ever starts at the current period.
func (rt *Runtime) RegisterPeriodic(name string, every time.Duration, fn PeriodicFunc) error {
	if every < time.Millisecond || every%time.Millisecond != 0 {
		return fmt.Errorf("periodic job %s: period %s must be a whole number of milliseconds", name, every)
	}
	return rt.RegisterJob(Job{Name: name, Run: func(ctx context.Context, jc *JobContext) error {
		return rt.runPeriodic(ctx, jc, name, every, fn)
	}})
}

func (rt *Runtime) runPeriodic(ctx context.Context, jc *JobContext, name string, every time.Duration, fn PeriodicFunc) error {
	periodMs := every.Milliseconds()
	for {
		var wait time.Duration
		err := jc.RunFenced(ctx, func(ctx context.Context, tx pgx.Tx) error {
			var nowMs int64
			if err := tx.QueryRow(ctx, "SELECT floor(extract(epoch FROM compute_now()) * 1000)::bigint").Scan(&nowMs); err != nil {
				return fmt.Errorf("read compute_now(): %w", err)
			}
			cur := nowMs / periodMs
			var last int64
			err := tx.QueryRow(ctx, "SELECT last_period FROM singleton_periods WHERE job = $1 FOR UPDATE", name).Scan(&last)
			if errors.Is(err, pgx.ErrNoRows) {
				last = cur - 1
			} else if err != nil {
				return fmt.Errorf("read last period of %s: %w", name, err)
			}
			if last >= cur {
				wait = time.Duration((cur+1)*periodMs-nowMs) * time.Millisecond
				return nil
			}
			next := last + 1
			if err := fn(ctx, tx, next); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `
INSERT INTO singleton_periods (job, period_ms, last_period, completed_at, completed_by, lease_epoch)
VALUES ($1, $2, $3, compute_now(), $4, $5)
ON CONFLICT (job) DO UPDATE SET period_ms = EXCLUDED.period_ms, last_period = EXCLUDED.last_period,
  completed_at = EXCLUDED.completed_at, completed_by = EXCLUDED.completed_by, lease_epoch = EXCLUDED.lease_epoch`,
				name, periodMs, next, jc.Lease.Owner, jc.Lease.Epoch); err != nil {
				return fmt.Errorf("record period %d of %s: %w", next, name, err)
			}
			rt.m.periods.WithLabelValues(name).Inc()
			if next >= cur {
				wait = time.Duration((cur+1)*periodMs-nowMs) * time.Millisecond
			}
			return nil
		})
		if errors.Is(err, coord.ErrLeaseLost) || ctx.Err() != nil {
			return err
		}
		if err != nil {
			rt.logger.Warn("periodic job failed; retrying", "job", name, "err", err)
			wait = min(every, time.Second)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-rt.clock.After(wait):
		}
	}
}
