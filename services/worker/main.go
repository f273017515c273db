// Command leasehold-worker runs the controllers group: the node reconciler
// (sharded by node id), the node scan, the site boot reconciler (sharded by
// site id) and its scan, the runs reconciler (sharded by run id) and its
// run-wake singleton, the command sweeper, the janitor, the
// metrics:command-latency collector and one webhook sink per configured sink.
//
// Flags fall back to LEASEHOLD_* environment variables (see
// docs/configuration.md); SIGTERM releases every lease and leaves.
package main

import (
	"context"
	"errors"
	"flag"
	"time"

	"github.com/grafana/dskit/services"

	"github.com/leasehold/leasehold/pkg/buildinfo"
	"github.com/leasehold/leasehold/pkg/cmdwake"
	"github.com/leasehold/leasehold/pkg/egress"
	"github.com/leasehold/leasehold/pkg/process"
	"github.com/leasehold/leasehold/pkg/reconcile"
	"github.com/leasehold/leasehold/services/worker/internal/collector"
	"github.com/leasehold/leasehold/services/worker/internal/janitor"
	"github.com/leasehold/leasehold/services/worker/internal/nodestate"
	"github.com/leasehold/leasehold/services/worker/internal/runs"
	"github.com/leasehold/leasehold/services/worker/internal/sinks"
	"github.com/leasehold/leasehold/services/worker/internal/siteboot"
	"github.com/leasehold/leasehold/services/worker/internal/sweeper"
)

type config struct {
	runtime      reconcile.Config
	nodes        nodestate.Config
	sites        siteboot.Config
	sweeper      sweeper.Config
	janitor      janitor.Config
	runs         runs.Config
	collectEvery time.Duration
	sinksRefresh time.Duration
	sinksEgress  egress.Policy
}

func main() {
	cfg := config{runtime: reconcile.DefaultConfig(), nodes: nodestate.DefaultConfig(), sites: siteboot.DefaultConfig(),
		sweeper: sweeper.DefaultConfig(), janitor: janitor.DefaultConfig(), runs: runs.DefaultConfig(),
		collectEvery: 10 * time.Second, sinksRefresh: 10 * time.Second,
		sinksEgress: egress.Policy{LoopbackFlag: "--sinks.allow-loopback", PrivateFlag: "--sinks.allow-private"}}
	process.Main(process.Spec{
		Name:     "worker",
		HTTPAddr: "127.0.0.1:9101",
		Flags: func(fs *flag.FlagSet) {
			cfg.runtime.RegisterFlags("coord.", fs)
			cfg.nodes.RegisterFlags("nodes.", fs)
			cfg.sites.RegisterFlags("sites.", fs)
			cfg.sweeper.RegisterFlags("sweeper.", fs)
			cfg.janitor.RegisterFlags("janitor.", fs)
			cfg.runs.RegisterFlags("runs.", fs)
			fs.DurationVar(&cfg.collectEvery, "collector.interval", cfg.collectEvery, "fleet gauge refresh period of the metrics:command-latency holder")
			fs.DurationVar(&cfg.sinksRefresh, "sinks.refresh", cfg.sinksRefresh, "how often the sinks table is re-read")
			fs.BoolVar(&cfg.sinksEgress.AllowLoopback, "sinks.allow-loopback", false, "deliver to sinks on loopback addresses (tests and single-machine development only)")
			fs.BoolVar(&cfg.sinksEgress.AllowPrivate, "sinks.allow-private", false, "deliver to sinks on private addresses (RFC 1918, 100.64.0.0/10, fc00::/7); metadata and link-local stay refused")
		},
		Validate: func() error {
			return errors.Join(cfg.runtime.Validate(), cfg.nodes.Validate(), cfg.sites.Validate(), cfg.sweeper.Validate(), cfg.janitor.Validate(), cfg.runs.Validate())
		},
		Build: func(ctx context.Context, p *process.Process) ([]services.Service, error) {
			cfg.runtime.Version = buildinfo.Version() // on the workers rows
			rt, err := reconcile.New(cfg.runtime, p.DB, reconcile.Options{
				Owner: p.Config.ID, NotifyURL: p.Config.NotifyURL(), Logger: p.Logger, Registerer: p.Registry, Clock: p.Clock,
			})
			if err != nil {
				return nil, err
			}
			runsCfg := cfg.runs
			runsCfg.NotifyURL = p.Config.NotifyURL()
			err = errors.Join(
				nodestate.Register(rt, cfg.nodes),
				siteboot.Register(rt, cfg.sites, p.Registry),
				sweeper.Register(rt, cfg.sweeper, p.Registry),
				janitor.Register(rt, cfg.janitor, p.Registry),
				collector.New(p.Registry, cfg.collectEvery).Register(rt),
				runs.Register(rt, runsCfg, cmdwake.New(p.DB, 0, p.Logger), p.Logger),
			)
			if err != nil {
				return nil, err
			}
			rt.AddHealth(p.Health)
			return []services.Service{rt, sinks.NewManager(p.DB, rt, p.Logger, cfg.sinksRefresh, cfg.sinksEgress)}, nil
		},
	})
}
