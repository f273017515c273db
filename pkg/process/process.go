package process

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/grafana/dskit/services"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jonboulle/clockwork"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.opentelemetry.io/otel/trace"

	"github.com/leasehold/leasehold/migrations"
	"github.com/leasehold/leasehold/pkg/buildinfo"
	"github.com/leasehold/leasehold/pkg/clock"
	"github.com/leasehold/leasehold/pkg/health"
	"github.com/leasehold/leasehold/pkg/pgdb"
)

// Process is what a service's build function receives.
type Process struct {
	// Name is the service's name (worker, gateway, …).
	Name string
	// Config is the parsed common configuration; Config.ID is always set.
	Config Config
	// Logger is the structured logger, tagged with service and id.
	Logger *slog.Logger
	// Registry is the process's own Prometheus registry.
	Registry *prometheus.Registry
	// DB is the pgx pool; nil when Spec.NoDatabase is set.
	DB *pgxpool.Pool
	// Health serves the health endpoints; add checks to it.
	Health *health.Handler
	// Mux is the health server's mux; services may mount more handlers.
	Mux *http.ServeMux
	// Clock is the process clock: real, or scaled by --clock.rate. Every
	// component's timers should run on it.
	Clock clockwork.Clock
	// Tracer is the OpenTelemetry tracer provider, also installed as the
	// global one: a no-op unless the OTEL_* environment turns tracing on.
	Tracer trace.TracerProvider
}

// Spec describes a service for Main.
type Spec struct {
	// Name is the service's name.
	Name string
	// HTTPAddr is the default health address.
	HTTPAddr string
	// IDPrefix prefixes generated process ids (e.g. "gw_").
	IDPrefix string
	// NoDatabase runs a service that needs no database: no database flags
	// (--database-url, --migrate, --id, --clock.* and the rest), no pool, no
	// migrations, no database readiness check; Process.DB is nil and
	// Process.Clock is the real clock.
	NoDatabase bool
	// GenericPlans plans the pool's cached statements once per connection
	// (pgdb.Config.GenericPlans): for services whose hot statements take
	// arrays as parameters.
	GenericPlans bool
	// ShutdownTimeout is the default of --shutdown-timeout (90 s when zero).
	ShutdownTimeout time.Duration
	// Identity, when set, names the process from the service's own flags
	// once they are valid: id replaces the --id (or generated) Config.ID and
	// attrs are added to every log line. Services without a database use it
	// (they have no --id).
	Identity func() (id string, attrs []any)
	// Flags registers the service's own flags.
	Flags func(fs *flag.FlagSet)
	// Validate checks the service's own flags.
	Validate func() error
	// Build constructs the service's components once the pool is open.
	Build func(ctx context.Context, p *Process) ([]services.Service, error)
}

// Main runs spec with os.Args and exits: 0 after a clean stop, 1 when a
// component failed, 2 on bad configuration.
func Main(spec Spec) {
	os.Exit(Run(context.Background(), spec, os.Args[1:], os.Stderr))
}

// Run is Main without the exit, for tests.
func Run(ctx context.Context, spec Spec, args []string, stderr *os.File) int {
	cfg := Config{HTTPAddr: spec.HTTPAddr, ShutdownTimeout: spec.ShutdownTimeout}
	fs := flag.NewFlagSet(spec.Name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	if spec.NoDatabase {
		cfg.registerServerFlags("", fs)
		cfg.ClockRate = 1
	} else {
		cfg.RegisterFlags("", fs)
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
	var err error
	if spec.NoDatabase {
		err = cfg.validateServer()
	} else {
		err = cfg.Validate()
	}
	if spec.Validate != nil {
		err = errors.Join(err, spec.Validate())
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

func run(parent context.Context, spec Spec, cfg Config, logger *slog.Logger) error {
	ctx, stop := signal.NotifyContext(parent, syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	tp, queryTracer, stopTracing, err := setupTracing(ctx, spec.Name, cfg.ID, logger)
	if err != nil {
		return err
	}
	defer stopTracing()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	h := health.New(reg, cfg.HealthToken)
	RegisterBuildInfo(reg, h)
	p := &Process{Name: spec.Name, Config: cfg, Logger: logger, Registry: reg, Health: h, Mux: h.ServeMux(), Tracer: tp}
	if spec.NoDatabase {
		p.Clock = clockwork.NewRealClock()
	} else {
		// Connect first: it refuses a standby before migrations would fail on it.
		db, err := pgdb.Connect(ctx, pgdb.Config{
			URL: cfg.DatabaseURL, AppName: "leasehold-" + spec.Name + ":" + cfg.ID,
			MaxConns: int32(cfg.MaxConns), Pooler: cfg.Pooler, Setting: "--database-url", Tracer: queryTracer,
			GenericPlans: spec.GenericPlans,
		})
		if err != nil {
			return fmt.Errorf("connect to database: %w", err)
		}
		defer db.Close()
		if err := checkSchema(ctx, cfg, logger); err != nil {
			return err
		}
		if p.Clock, err = processClock(ctx, cfg, db, logger); err != nil {
			return err
		}
		h.AddReadiness("database", func(ctx context.Context) error { return db.Ping(ctx) })
		p.DB = db
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

// processClock builds the clock of --clock.rate. A scaled clock must agree
// with the database's compute_now() (scaled by clock.InstallSQL): a process
// started against an unscaled database refuses to run instead of treating
// every lease as minutes off.
func processClock(ctx context.Context, cfg Config, db *pgxpool.Pool, logger *slog.Logger) (clockwork.Clock, error) {
	s, err := cfg.Scale()
	if err != nil {
		return nil, err
	}
	clk, err := clock.New(s)
	if err != nil || s.Rate == 1 {
		return clk, err
	}
	var dbNow time.Time
	if err := db.QueryRow(ctx, "SELECT compute_now()").Scan(&dbNow); err != nil {
		return nil, fmt.Errorf("read compute_now(): %w", err)
	}
	if off := clk.Now().Sub(dbNow); off.Abs() > time.Second {
		return nil, fmt.Errorf("--clock.rate %g: the database's compute_now() is %s off the scaled clock; install the same scale with clock.InstallSQL", s.Rate, off.Round(time.Millisecond))
	}
	logger.Warn("scaled clock: timers run faster than wall time (benches only)", "rate", s.Rate, "epoch", s.Epoch)
	return clk, nil
}

// checkSchema applies migrations when asked and refuses a database newer
// than the binary either way.
func checkSchema(ctx context.Context, cfg Config, logger *slog.Logger) error {
	url := cfg.ListenURL // migrations take a session lock: prefer the direct URL
	if url == "" {
		url = cfg.DatabaseURL
	}
	db, err := migrations.Open(url)
	if err != nil {
		return err
	}
	defer db.Close()
	var st migrations.Status
	if cfg.Migrate {
		st, err = migrations.Up(ctx, db, logger)
	} else {
		st, err = migrations.Check(ctx, db)
	}
	if err != nil {
		return fmt.Errorf("schema: %w", err)
	}
	if st.Pending > 0 {
		logger.Warn("database has pending migrations; run with --migrate or `make migrate`", "current", st.Current, "target", st.Target, "pending", st.Pending)
	}
	return nil
}

type httpService struct {
	*services.BasicService
	ln  net.Listener
	srv *http.Server
}

func newHTTPService(addr string, h http.Handler, logger *slog.Logger) (*httpService, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on --http-addr %s: %w", addr, err)
	}
	s := &httpService{ln: ln, srv: &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      10 * time.Second,
		IdleTimeout:       60 * time.Second,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
	}}
	s.BasicService = services.NewBasicService(nil, s.running, nil).WithName("http")
	return s, nil
}

func (s *httpService) addr() string { return s.ln.Addr().String() }

func (s *httpService) running(ctx context.Context) error {
	return Serve(ctx, s.srv, s.ln, "health server", 5*time.Second)
}

// Serve runs srv on ln (TLS when srv.TLSConfig is set) until ctx ends, then
// shuts it down gracefully within grace. It returns an error only when the
// server stopped by itself.
func Serve(ctx context.Context, srv *http.Server, ln net.Listener, name string, grace time.Duration) error {
	useTLS := srv.TLSConfig != nil // Serve mutates the TLS settings: read first
	errc := make(chan error, 1)
	go func() {
		if useTLS {
			errc <- srv.ServeTLS(ln, "", "")
		} else {
			errc <- srv.Serve(ln)
		}
	}()
	select {
	case err := <-errc:
		return fmt.Errorf("%s: %w", name, err)
	case <-ctx.Done():
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	_ = srv.Shutdown(shutdownCtx)
	<-errc //nolint:errcheck // after Shutdown, Serve returns http.ErrServerClosed
	return nil
}
