// Command leasehold-site-agent runs a site's boot server (proxy DHCP, TFTP,
// UEFI HTTP boot, iPXE scripts), image cache and BMC control, connected to the control plane as a node of
// kind site_agent (see docs/site-agent.md). It needs no database.
//
// Flags fall back to LEASEHOLD_* environment variables; SIGTERM stops it
// gracefully. A configuration that breaks self-fence < TTL <= promotion is
// refused with exit code 2.
package main

import (
	"context"
	"flag"
	"time"

	"github.com/grafana/dskit/services"

	"github.com/leasehold/leasehold/pkg/buildinfo"
	"github.com/leasehold/leasehold/pkg/lifecycle"
	"github.com/leasehold/leasehold/services/site-agent/internal/agent"
)

func main() {
	var cfg agent.Config
	lifecycle.Main(lifecycle.Spec{
		Name:            "site-agent",
		HTTPAddr:        "127.0.0.1:9105",
		ShutdownTimeout: 30 * time.Second,
		Flags:           func(fs *flag.FlagSet) { cfg.RegisterFlags("", fs) },
		Validate:        cfg.Resolve,
		Identity:        func() (string, []any) { return cfg.NodeID, []any{"site", cfg.SiteID} },
		Build: func(_ context.Context, p *lifecycle.Process) ([]services.Service, error) {
			a, err := agent.New(cfg, agent.Deps{Logger: p.Logger, Registry: p.Registry, Health: p.Health, Clock: p.Clock, Version: buildinfo.Version()})
			if err != nil {
				return nil, err
			}
			return []services.Service{a}, nil
		},
	})
}
