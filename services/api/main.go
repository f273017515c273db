// Command leasehold-api runs ControlService, the operator and client API
// (docs/api.md).
//
// Flags fall back to LEASEHOLD_* environment variables (see
// docs/configuration.md); API tokens come from --tokens-file and/or
// LEASEHOLD_API_TOKENS. SIGTERM stops it gracefully.
//
// `leasehold-api token create --role <role>` prints a new random token and
// its hashed tokens-file line, and exits. `leasehold-api join-token
// create|ls|revoke` manages join tokens in the database (--database-url) and
// exits; create prints the token on its first line.
package main

import (
	"context"
	"flag"
	"os"
	"os/signal"
	"syscall"

	"github.com/grafana/dskit/services"

	"github.com/leasehold/leasehold/pkg/process"
	"github.com/leasehold/leasehold/services/api/internal/api"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "token" {
		os.Exit(api.TokenCommand(os.Args[2:], os.Stdout, os.Stderr))
	}
	if len(os.Args) > 1 && os.Args[1] == "join-token" {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		code := api.JoinTokenCommand(ctx, os.Args[2:], os.Stdout, os.Stderr)
		stop()
		os.Exit(code)
	}
	var cfg api.Config
	process.Main(process.Spec{
		Name:     "api",
		HTTPAddr: "127.0.0.1:9104",
		IDPrefix: "api_",
		Flags: func(fs *flag.FlagSet) {
			cfg.RegisterFlags("", fs)
			cfg.Tokens = os.Getenv(api.TokensEnv)
		},
		Validate:  cfg.Validate,
		Listeners: cfg.Listeners,
		Build: func(ctx context.Context, p *process.Process) ([]services.Service, error) {
			s, err := api.New(cfg, api.Deps{DB: p.DB, Logger: p.Logger, Registry: p.Registry, Health: p.Health, NotifyURL: p.Config.NotifyURL(),
				ID: p.Config.ID, MaxConns: int32(p.Config.MaxConns)})
			if err != nil {
				return nil, err
			}
			return []services.Service{s}, nil
		},
	})
}
