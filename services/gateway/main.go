// Command leasehold-gateway runs node sessions: Connect streams, dispatch, admission and drain.
//
// Flags fall back to LEASEHOLD_* environment variables (see docs/gateway.md);
// SIGTERM drains the streams, releases the gateway lease and exits 0. A
// gateway that fences itself (its lease lost or unrenewed for half its TTL)
// closes every stream and exits 1, so its supervisor restarts it with a fresh
// id.
package main

import (
	"context"
	"flag"

	"github.com/grafana/dskit/services"

	"github.com/leasehold/leasehold/pkg/process"
	"github.com/leasehold/leasehold/services/gateway/internal/gateway"
)

func main() {
	var cfg gateway.Config
	process.Main(process.Spec{
		Name:     "gateway",
		HTTPAddr: "127.0.0.1:9103",
		IDPrefix: "gw_",
		// The group commit and dispatch take arrays: plan them once.
		GenericPlans: true,
		Flags:        func(fs *flag.FlagSet) { cfg.RegisterFlags("", fs) },
		Validate:     cfg.Validate,
		Listeners:    cfg.Listeners,
		Build: func(ctx context.Context, p *process.Process) ([]services.Service, error) {
			g, err := gateway.New(cfg, gateway.Deps{
				ID:        p.Config.ID,
				DB:        p.DB,
				NotifyURL: p.Config.NotifyURL(),
				Logger:    p.Logger,
				Registry:  p.Registry,
				Health:    p.Health,
				Clock:     p.Clock,
			})
			if err != nil {
				return nil, err
			}
			return []services.Service{g}, nil
		},
	})
}
