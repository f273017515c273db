// Command leasehold-gateway runs node sessions: Connect streams, dispatch, admission and drain.
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
		Name:     "gateway",
		HTTPAddr: "127.0.0.1:9103",
		IDPrefix: "gw_",
		Build: func(ctx context.Context, p *process.Process) ([]services.Service, error) {
			return nil, nil
		},
	})
}
