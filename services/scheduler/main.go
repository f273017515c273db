// Command leasehold-scheduler runs the scheduler group: the pool-lease
// placer, sharded by pool id over the scheduler/shard:<n> leases, and the
// scan that enqueues pools with pending leases. It never takes node shards.
//
// Flags fall back to LEASEHOLD_* environment variables (see
// docs/configuration.md); SIGTERM releases every lease and leaves.
package main

import (
	"context"
	"errors"
	"flag"

	"github.com/grafana/dskit/services"

	"github.com/leasehold/leasehold/pkg/buildinfo"
	"github.com/leasehold/leasehold/pkg/process"
	"github.com/leasehold/leasehold/pkg/reconcile"
	"github.com/leasehold/leasehold/services/scheduler/internal/placer"
)

func main() {
	rcfg, pcfg := reconcile.DefaultConfig(), placer.DefaultConfig()
	process.Main(process.Spec{
		Name:     "scheduler",
		HTTPAddr: "127.0.0.1:9102",
		Flags: func(fs *flag.FlagSet) {
			rcfg.RegisterFlags("coord.", fs)
			pcfg.RegisterFlags("placer.", fs)
		},
		Validate: func() error { return errors.Join(rcfg.Validate(), pcfg.Validate()) },
		Build: func(ctx context.Context, p *process.Process) ([]services.Service, error) {
			rcfg.Version = buildinfo.Version() // on the workers rows
			rt, err := reconcile.New(rcfg, p.DB, reconcile.Options{
				Owner: p.Config.ID, NotifyURL: p.Config.NotifyURL(), Logger: p.Logger, Registerer: p.Registry, Clock: p.Clock,
			})
			if err != nil {
				return nil, err
			}
			if err := placer.Register(rt, pcfg); err != nil {
				return nil, err
			}
			rt.AddHealth(p.Health)
			return []services.Service{rt}, nil
		},
	})
}
