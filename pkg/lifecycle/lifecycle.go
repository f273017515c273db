// Package lifecycle is the skeleton of a leasehold program's main that needs
// no database: flags with LEASEHOLD_* environment fallbacks, a slog logger, a
// Prometheus registry, the health endpoints, and a dskit services.Manager
// that starts the program's components and stops them on SIGTERM or SIGINT,
// or when any of them fails. The node and site agents run on it alone, so
// they link no database driver, no migrations and no trace exporter;
// pkg/process builds the control plane's services on it, adding the pool,
// the schema check and tracing through Spec.Setup.
package lifecycle

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jonboulle/clockwork"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/leasehold/leasehold/pkg/buildinfo"
	"github.com/leasehold/leasehold/pkg/health"
)

// Process is what a program's Setup and Build receive.
type Process struct {
	// Name is the program's name (node, site-agent, …).
	Name string
	// Config is the parsed common configuration; Config.ID is always set.
	Config Config
	// Logger is the structured logger, tagged with service and id.
	Logger *slog.Logger
	// Registry is the process's own Prometheus registry (Go runtime,
	// process and build metrics already registered).
	Registry *prometheus.Registry
	// Health serves the health endpoints; add checks to it.
	Health *health.Handler
	// Mux is the health server's mux; programs may mount more handlers.
	Mux *http.ServeMux
	// Clock is the process clock: the real clock unless Setup replaces it.
	// Every component's timers should run on it.
	Clock clockwork.Clock
}

// Spec describes a program for Main.
type Spec struct {
	// Name is the program's name.
	Name string
	// HTTPAddr is the default health address.
	HTTPAddr string
	// IDPrefix prefixes generated process ids (Name + "-" when empty).
	IDPrefix string
	// ShutdownTimeout is the default of --shutdown-timeout (90 s when zero).
	ShutdownTimeout time.Duration
	// Identity, when set, names the process once the flags are valid: id
	// (when not empty) is Config.ID and attrs are added to every log line.
	Identity func() (id string, attrs []any)
	// Flags registers the program's own flags.
	Flags func(fs *flag.FlagSet)
	// Validate checks the program's own flags; its error names them.
	Validate func() error
	// Listeners, when set, lists the program's listeners that carry
	// credentials or commands once the flags are valid; one that would
	// serve plaintext beyond loopback refuses the start (CheckPlaintext).
	Listeners func() []Listener
	// Setup, when set, runs once logging, metrics and health exist and
	// before Build (pkg/process opens the database here). The cleanup it
	// returns runs after every component has stopped.
	Setup func(ctx context.Context, p *Process) (cleanup func(), err error)
	// Build constructs the program's components.
	Build func(ctx context.Context, p *Process) ([]services.Service, error)
}

// Main runs spec with os.Args and exits: 0 after a clean stop, 1 when a
// component failed, 2 on bad configuration.
func Main(spec Spec) {
	os.Exit(Run(context.Background(), spec, os.Args[1:], os.Stderr))
}

// Run is Main without the exit, for tests. --version prints the build and
// returns 0 before anything else is checked.
func Run(ctx context.Context, spec Spec, args []string, stderr *os.File) int {
	cfg := Config{HTTPAddr: spec.HTTPAddr, ShutdownTimeout: spec.ShutdownTimeout}
	fs := flag.NewFlagSet(spec.Name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg.RegisterFlags("", fs)
	if spec.Listeners != nil {
		cfg.RegisterPlaintextFlag("", fs)
	}
	showVersion := RegisterVersionFlag(fs)
	if spec.Flags != nil {
		spec.Flags(fs)
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *showVersion {
		PrintVersion(os.Stdout, spec.Name)
		return 0
	}
	if err := ApplyEnv(fs); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", spec.Name, err)
		return 2
	}
	err := cfg.Validate()
	if spec.Validate != nil {
		err = errors.Join(err, spec.Validate())
	}
	if spec.Listeners != nil {
		err = errors.Join(err, CheckPlaintext(spec.Listeners(), cfg.InsecurePlaintext))
	}
	if err != nil {
		fmt.Fprintf(stderr, "%s: invalid configuration:\n%v\n", spec.Name, err)
		return 2
	}
	var attrs []any
	if spec.Identity != nil {
		cfg.ID, attrs = spec.Identity()
	}
	if cfg.ID == "" {
		prefix := spec.IDPrefix
		if prefix == "" {
			prefix = spec.Name + "-"
		}
		cfg.ID = NewID(prefix)
	}
	logger := NewLogger(stderr, cfg.LogLevel, cfg.LogFormat).With("service", spec.Name, "id", cfg.ID).With(attrs...)
	if err := run(ctx, spec, cfg, logger); err != nil {
		logger.Error("exiting after failure", "err", err)
		return 1
	}
	return 0
}

func run(parent context.Context, spec Spec, cfg Config, logger *slog.Logger) error {
	ctx, stop := signal.NotifyContext(parent, syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	h := health.New(reg, cfg.HealthToken)
	RegisterBuildInfo(reg, h)
	p := &Process{Name: spec.Name, Config: cfg, Logger: logger, Registry: reg, Health: h, Mux: h.ServeMux(), Clock: clockwork.NewRealClock()}
	if spec.Setup != nil {
		cleanup, err := spec.Setup(ctx, p)
		if err != nil {
			return err
		}
		if cleanup != nil {
			defer cleanup()
		}
	}
	components, err := spec.Build(ctx, p)
	if err != nil {
		return fmt.Errorf("build %s: %w", spec.Name, err)
	}
	httpSvc, err := newHTTPService(cfg.HTTPAddr, p.Mux, logger)
	if err != nil {
		return err
	}
	all := append([]services.Service{httpSvc}, components...)
	mgr, err := services.NewManager(all...)
	if err != nil {
		return fmt.Errorf("services: %w", err)
	}
	failed := make(chan error, 1)
	mgr.AddListener(services.NewManagerListener(nil, nil, func(s services.Service) {
		select {
		case failed <- fmt.Errorf("component failed: %w", s.FailureCase()):
		default:
		}
		mgr.StopAsync()
	}))
	if err := mgr.StartAsync(context.WithoutCancel(ctx)); err != nil {
		return fmt.Errorf("start: %w", err)
	}
	logger.Info("started", "http_addr", httpSvc.addr(), "components", len(components), "version", buildinfo.Version())

	var failure error
	select {
	case <-ctx.Done():
		logger.Info("stopping on signal")
	case failure = <-failed:
	}
	mgr.StopAsync()
	stopCtx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownTimeout)
	defer cancel()
	if err := mgr.AwaitStopped(stopCtx); err != nil {
		return fmt.Errorf("graceful stop did not finish in %s: %w", cfg.ShutdownTimeout, err)
	}
	if failure == nil {
		for _, s := range all {
			if s.State() == services.Failed {
				failure = fmt.Errorf("component failed: %w", s.FailureCase())
			}
		}
	}
	if failure != nil {
		return failure
	}
	logger.Info("stopped cleanly")
	return nil
}

// NewLogger returns a slog logger writing level and format to w.
func NewLogger(w *os.File, level, format string) *slog.Logger {
	var lv slog.Level
	_ = lv.UnmarshalText([]byte(level))
	opts := &slog.HandlerOptions{Level: lv}
	if format == "text" {
		return slog.New(slog.NewTextHandler(w, opts))
	}
	return slog.New(slog.NewJSONHandler(w, opts))
}
