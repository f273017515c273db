// Command testworker is a worker process for the reconcile package's
// failover tests: the real runtime with a sharded reconciler that logs every
// run, inside its fenced transaction, to reconcile_log, and a periodic
// singleton that logs to period_log. The tests create both tables.
package main

import (
	"context"
	"flag"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/coord"
	"github.com/leasehold/leasehold/pkg/process"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

func main() {
	cfg := reconcile.DefaultConfig()
	var work time.Duration
	process.Main(process.Spec{
		Name:     "testworker",
		HTTPAddr: "127.0.0.1:0",
		Flags: func(fs *flag.FlagSet) {
			cfg.RegisterFlags("coord.", fs)
			fs.DurationVar(&work, "work", 20*time.Millisecond, "time each reconcile spends inside its fenced transaction")
		},
		Validate: cfg.Validate,
		Build: func(ctx context.Context, p *process.Process) ([]services.Service, error) {
			rt, err := reconcile.New(cfg, p.DB, reconcile.Options{
				Owner: p.Config.ID, NotifyURL: p.Config.NotifyURL(), Logger: p.Logger, Registerer: p.Registry,
			})
			if err != nil {
				return nil, err
			}
			owner := p.Config.ID
			err = rt.RegisterSharded(reconcile.Sharded{Name: "logkeys", Group: coord.Controllers,
				Reconcile: func(ctx context.Context, tx pgx.Tx, key string) error {
					if _, err := tx.Exec(ctx, "INSERT INTO reconcile_log (key, owner, started_at) VALUES ($1, $2, compute_now())", key, owner); err != nil {
						return err
					}
					if _, err := tx.Exec(ctx, "SELECT pg_sleep($1)", work.Seconds()); err != nil {
						return err
					}
					_, err := tx.Exec(ctx, "UPDATE reconcile_log SET finished_at = compute_now() WHERE key = $1 AND owner = $2 AND finished_at IS NULL", key, owner)
					return err
				}})
			if err != nil {
				return nil, err
			}
			err = rt.RegisterPeriodic("ticker", 500*time.Millisecond, func(ctx context.Context, tx pgx.Tx, period int64) error {
				_, err := tx.Exec(ctx, "INSERT INTO period_log (period, owner, at) VALUES ($1, $2, compute_now())", period, owner)
				return err
			})
			if err != nil {
				return nil, err
			}
			err = rt.RegisterJob(reconcile.Job{Name: "holder", Run: func(ctx context.Context, jc *reconcile.JobContext) error {
				<-ctx.Done()
				return nil
			}})
			if err != nil {
				return nil, err
			}
			rt.AddHealth(p.Health)
			return []services.Service{rt}, nil
		},
	})
}
