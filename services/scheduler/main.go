// Command leasehold-scheduler runs the scheduler group: the pool-lease placer.
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
		Name:     "scheduler",
		HTTPAddr: "127.0.0.1:9102",
		IDPrefix: "",
		Build: func(ctx context.Context, p *process.Process) ([]services.Service, error) {
			return nil, nil
		},
	})
}
