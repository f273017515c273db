// Command leasehold-site-agent runs a site's boot server (proxy DHCP, iPXE), image cache and BMC control.
//
// Flags fall back to LEASEHOLD_* environment variables (see docs/configuration.md);
// SIGTERM stops it gracefully.
package main

import (
	"context"

	"github.com/grafana/dskit/services"

	"github.com/leasehold/leasehold/pkg/process"
)

func main() {
	process.Main(process.Spec{
		Name:     "site-agent",
		HTTPAddr: "127.0.0.1:9105",
		IDPrefix: "",
		Build: func(ctx context.Context, p *process.Process) ([]services.Service, error) {
			return nil, nil
		},
	})
}
