// Command leasehold-node is the agent that runs on every machine of a
// fleet (docs/node.md): it holds the machine's session with a gateway,
// executes commands (exec, script, file.put, file.get, facts, reboot) at
// most once each, and serves the tunnels its configuration allows.
//
//	leasehold-node join --api-url URL --token-file F   enroll this machine once
//	leasehold-node rotate-credential --api-url URL      replace the credential
//	leasehold-node [flags]                              run the agent
//
// Flags fall back to LEASEHOLD_* environment variables; SIGTERM stops it
// after the running commands have been stopped and reported.
package main

import (
	"context"
	"flag"
	"os"
	"time"

	"github.com/grafana/dskit/services"

	"github.com/leasehold/leasehold/pkg/buildinfo"
	"github.com/leasehold/leasehold/pkg/lifecycle"
	"github.com/leasehold/leasehold/services/node/internal/agent"
)

func main() {
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case "join":
			os.Exit(agent.JoinCommand(os.Args[2:], os.Stdout, os.Stderr))
		case "rotate-credential":
			os.Exit(agent.RotateCommand(os.Args[2:], os.Stdout, os.Stderr))
		case "run":
			os.Args = append(os.Args[:1], os.Args[2:]...)
		}
	}
	var cfg agent.Config
	lifecycle.Main(lifecycle.Spec{
		Name:            "node",
		HTTPAddr:        "127.0.0.1:9106",
		ShutdownTimeout: 30 * time.Second,
		Flags:           func(fs *flag.FlagSet) { cfg.RegisterFlags(fs) },
		Validate:        cfg.Resolve,
		Identity:        func() (string, []any) { return cfg.NodeID, nil },
		Build: func(_ context.Context, p *lifecycle.Process) ([]services.Service, error) {
			a, err := agent.New(cfg, agent.Deps{Logger: p.Logger, Registry: p.Registry, Health: p.Health, Clock: p.Clock, Version: buildinfo.Version()})
			if err != nil {
				return nil, err
			}
			return []services.Service{a}, nil
		},
	})
}
