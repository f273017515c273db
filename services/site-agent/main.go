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
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/leasehold/leasehold/pkg/buildinfo"
	"github.com/leasehold/leasehold/pkg/health"
	"github.com/leasehold/leasehold/pkg/process"
	"github.com/leasehold/leasehold/services/site-agent/internal/agent"
)

func main() {
	var (
		cfg                            agent.Config
		httpAddr, token, level, format string
		shutdownTimeout                time.Duration
	)
	fs := flag.NewFlagSet("site-agent", flag.ContinueOnError)
	cfg.RegisterFlags(fs)
	fs.StringVar(&httpAddr, "http-addr", "127.0.0.1:9105", "address of /livez, /readyz, /healthz/detail and /metrics")
	fs.StringVar(&token, "health-token", "", "bearer token for /healthz/detail (empty disables it)")
	fs.StringVar(&level, "log-level", "info", "log level: debug, info, warn, error")
	fs.StringVar(&format, "log-format", "json", "log format: json or text")
	fs.DurationVar(&shutdownTimeout, "shutdown-timeout", 30*time.Second, "how long a graceful stop may take")
	showVersion := process.RegisterVersionFlag(fs)
	if err := fs.Parse(os.Args[1:]); err != nil {
		os.Exit(2)
	}
	if *showVersion {
		process.PrintVersion(os.Stdout, "site-agent")
		return
	}
	if err := errors.Join(process.ApplyEnv(fs), cfg.Resolve()); err != nil {
		fmt.Fprintf(os.Stderr, "site-agent: invalid configuration:\n%v\n", err)
		os.Exit(2)
	}
	log := process.NewLogger(os.Stderr, level, format).With("service", "site-agent", "id", cfg.NodeID, "site", cfg.SiteID)
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	h := health.New(reg, token)
	process.RegisterBuildInfo(reg, h)

	a, err := agent.New(cfg, agent.Deps{Logger: log, Registry: reg, Health: h, Version: buildinfo.Version()})
	if err != nil {
		log.Error("build site agent", "err", err)
		os.Exit(1)
	}
	ln, err := net.Listen("tcp", httpAddr)
	if err != nil {
		log.Error("listen on --http-addr", "addr", httpAddr, "err", err)
		os.Exit(1)
	}
	srv := &http.Server{Handler: h.ServeMux(), ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second,
		WriteTimeout: 10 * time.Second, IdleTimeout: 60 * time.Second}
	go func() { _ = srv.Serve(ln) }()

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := services.StartAndAwaitRunning(ctx, a); err != nil {
		log.Error("start site agent", "err", err)
		os.Exit(1)
	}
	log.Info("started", "http_addr", ln.Addr().String(), "version", buildinfo.Version())
	terminated := make(chan struct{})
	go func() { _ = a.AwaitTerminated(context.Background()); close(terminated) }()
	select {
	case <-ctx.Done():
		log.Info("stopping on signal")
	case <-terminated:
	}
	stopCtx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
	defer cancel()
	_ = services.StopAndAwaitTerminated(stopCtx, a)
	_ = srv.Shutdown(stopCtx)
	if err := a.FailureCase(); err != nil {
		log.Error("exiting after failure", "err", err)
		os.Exit(1)
	}
	log.Info("stopped cleanly")
}
